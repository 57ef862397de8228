"""quantization_config parsing: the FP8 formats pdserve loads, and a clear error for everything else."""

import copy

import pytest

from cluster.errors import ModelLoadError
from cluster.model.quantization import Fp8Scheme, QuantConfig

W_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
A_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
# As llm-compressor writes a FP8-dynamic checkpoint's config.json (quantization_config part).
CT_FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": W_CHANNEL, "input_activations": A_TOKEN,
                                  "output_activations": None, "format": "float-quantized"}},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
}


def ct(**changes) -> dict:
    qc = copy.deepcopy(CT_FP8_DYNAMIC)
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        (group if key in ("weights", "input_activations", "output_activations", "targets") else qc)[key] = value
    return {"quantization_config": qc}


def test_no_quantization_config_is_unquantized_and_fp8_quantizes_at_load():
    assert not QuantConfig.from_checkpoint({}).quantized
    online = QuantConfig.from_checkpoint({}, "fp8")
    s = online.scheme_for(["model.layers.0.self_attn.q_proj"])
    assert s == Fp8Scheme("channel", "dynamic", online=True)
    assert online.scheme_for(["lm_head"]) is None


def test_compressed_tensors_fp8_dynamic_and_static():
    q = QuantConfig.from_checkpoint(ct())
    assert q.method == "compressed-tensors" and not q.kv_cache_scales
    assert q.scheme_for(["model.layers.3.mlp.down_proj"]) == Fp8Scheme("channel", "dynamic")
    assert q.scheme_for(["lm_head"]) is None
    static = QuantConfig.from_checkpoint(ct(weights=dict(W_CHANNEL, strategy="tensor"),
                                            input_activations=dict(A_TOKEN, strategy="tensor", dynamic=False),
                                            kv_cache_scheme=dict(W_CHANNEL, strategy="tensor")))
    assert static.scheme_for(["model.layers.0.self_attn.o_proj"]) == Fp8Scheme("tensor", "static")
    assert static.kv_cache_scales
    weight_only = QuantConfig.from_checkpoint(ct(input_activations=None))
    assert weight_only.scheme_for(["model.layers.0.mlp.up_proj"]).activations == "none"


def test_ignore_and_regex_targets():
    q = QuantConfig.from_checkpoint(ct(ignore=["lm_head", "re:.*layers\\.1\\..*"]))
    assert q.scheme_for(["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]) is None
    assert q.scheme_for(["model.layers.10.mlp.gate_proj"]) is not None
    only_mlp = QuantConfig.from_checkpoint(ct(targets=["re:.*mlp.*"]))
    assert only_mlp.scheme_for(["model.layers.0.self_attn.q_proj"]) is None
    assert only_mlp.scheme_for(["model.layers.0.mlp.down_proj"]) is not None


def test_fused_parts_quantized_differently_is_an_error():
    q = QuantConfig.from_checkpoint(ct(ignore=["lm_head", "model.layers.0.self_attn.k_proj"]))
    with pytest.raises(ModelLoadError, match="quantized differently.*k_proj: unquantized"):
        q.scheme_for(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"])


def test_hf_fp8_block_and_per_tensor():
    block = QuantConfig.from_checkpoint({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}})
    s = block.scheme_for(["model.layers.1.self_attn.o_proj"])
    assert s.weight_strategy == "block" and s.block == (128, 128) and s.scale_name == "weight_scale_inv"
    assert block.scheme_for(["model.layers.0.mlp.down_proj"]) is None
    # --quantization fp8 on an fp8 checkpoint uses the checkpoint's scales (as vLLM does)
    assert QuantConfig.from_checkpoint({"quantization_config": {"quant_method": "fp8"}}, "fp8").method == "hf-fp8"
    static = QuantConfig.from_checkpoint({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                                  "weight_block_size": None}})
    assert static.scheme_for(["model.layers.0.mlp.up_proj"]) == Fp8Scheme("tensor", "static")


@pytest.mark.parametrize("config,match", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
    (ct(weights=dict(W_CHANNEL, type="int")), "unsupported quantization 'int' with num_bits=8"),
    (ct(weights=dict(W_CHANNEL, num_bits=4, type="int", strategy="group", group_size=128)), "num_bits=4"),
    (ct(weights=dict(W_CHANNEL, strategy="group", group_size=128)), "weight strategy 'group'"),
    (ct(weights=dict(W_CHANNEL, strategy="block", block_structure=[64, 64])), r"block_structure \[64, 64\]"),
    (ct(weights=dict(W_CHANNEL, symmetric=False)), "asymmetric"),
    (ct(input_activations=dict(A_TOKEN, strategy="tensor", dynamic=True)), "activation strategy 'tensor'"),
    (ct(output_activations=A_TOKEN), "output_activations"),
    (ct(format="pack-quantized"), "format 'pack-quantized'"),
    (ct(format="nvfp4-pack-quantized"), "nvfp4"),
    (ct(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    (ct(quantization_status="frozen"), "quantization_status 'frozen'"),
    (ct(kv_cache_scheme=dict(A_TOKEN)), "kv_cache_scheme 'token'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}}, r"weight_block_size \[1, 128\]"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt 'e5m2'"),
])
def test_everything_else_is_an_error_naming_it(config, match):
    with pytest.raises(ModelLoadError, match=match):
        QuantConfig.from_checkpoint(config)


def test_quantization_flag_values():
    with pytest.raises(ModelLoadError, match="unsupported quantization 'int8'"):
        QuantConfig.from_checkpoint({}, "int8")
    with pytest.raises(ModelLoadError, match="already quantized.*compressed-tensors"):
        QuantConfig.from_checkpoint(ct(), "fp8")
