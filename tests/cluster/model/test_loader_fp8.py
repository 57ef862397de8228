"""FP8 checkpoints load into the fused FP8 layers exactly as written: compressed-tensors checkpoints
written by that library (per-channel dynamic, per-tensor static with k/v scales, weight-only, block),
Hugging Face's block-wise fp8 format, and --quantization fp8 on a float checkpoint."""

import json
import shutil

import pytest
import torch
from fp8_checkpoints import block_quantize, write_compressed_tensors, write_float_llama, write_hf_fp8_block
from safetensors.torch import load_file, save_file

from cluster.errors import ModelLoadError
from cluster.kernels.reference import fp8_dequantize_weight
from cluster.model.linear import Fp8LinearMethod, UnquantizedLinearMethod
from cluster.model.loader import load_model


@pytest.fixture(scope="module")
def ct_dynamic(demo_model_dir, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return write_compressed_tensors(demo_model_dir, tmp_path_factory.mktemp("ct_dyn"), "FP8_DYNAMIC")


@pytest.fixture(scope="module")
def block_shape_dir(demo_model_dir, tmp_path_factory):
    """Fused parts of 128 rows, so 128 x 128 scale blocks don't straddle q/k/v or gate/up."""
    return write_float_llama(demo_model_dir, tmp_path_factory.mktemp("blockshape"), seed=3, hidden_size=256,
                             intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64)


def _file_tensors(d):
    return load_file(d / "model.safetensors")


def _library_dequantized(d, module):
    """The library's own dequantization of one module of the checkpoint (float32 [N, K])."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    t = _file_tensors(d)
    args = json.loads((d / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    return dequantize(t[module + ".weight"], t[module + ".weight_scale"], args=QuantizationArgs(**args)).float()


def _ours(layer, rows):
    w = fp8_dequantize_weight(layer.weight, layer.weight_scale, layer.method.scheme.block)
    return w[rows[0] : rows[1]]


def test_compressed_tensors_fp8_dynamic_loads_as_written(ct_dynamic):
    cfg = json.loads((ct_dynamic / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "float-quantized"
    model = load_model(ct_dynamic)
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8LinearMethod) and qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.method.scheme.weight_strategy == "channel" and qkv.method.scheme.activations == "dynamic"
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.float32
    t = _file_tensors(ct_dynamic)
    p = "model.layers.1.self_attn."
    want = torch.cat([t[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.weight.view(torch.uint8), want.view(torch.uint8))  # the e4m3 bytes, untouched
    assert torch.equal(qkv.weight_scale, torch.cat([t[p + n + ".weight_scale"].flatten()
                                                    for n in ("q_proj", "k_proj", "v_proj")]))
    q, kv = model.cfg.q_size, model.cfg.kv_size
    for name, rows in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
        torch.testing.assert_close(_ours(qkv, rows), _library_dequantized(ct_dynamic, p + name), rtol=0, atol=0)
    down = model.layers[0].mlp.down_proj
    torch.testing.assert_close(_ours(down, (0, down.output_size)),
                               _library_dequantized(ct_dynamic, "model.layers.0.mlp.down_proj"), rtol=0, atol=0)


def test_static_per_tensor_with_kv_scales(demo_model_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    kv_scales = {i: (0.05 * (i + 1), 0.02 * (i + 1)) for i in range(4)}
    d = write_compressed_tensors(demo_model_dir, tmp_path / "ct", "FP8", kv_scales=kv_scales)
    model = load_model(d)
    t = _file_tensors(d)
    p = "model.layers.2.self_attn."
    qkv = model.layers[2].self_attn.qkv_proj
    assert qkv.method.scheme.weight_strategy == "tensor" and qkv.method.scheme.activations == "static"
    q, kv = model.cfg.q_size, model.cfg.kv_size
    # One scale per part, in its rows: fusing q/k/v with different per-tensor scales stays exact.
    for name, (lo, hi) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
        assert (qkv.weight_scale[lo:hi] == t[p + name + ".weight_scale"]).all()
    assert qkv.input_scale.item() == max(t[p + n + ".input_scale"].item() for n in ("q_proj", "k_proj", "v_proj"))
    attn = model.layers[2].self_attn
    assert (attn.k_scale, attn.v_scale) == pytest.approx(kv_scales[2])


def test_weight_only_and_block_compressed_tensors(demo_model_dir, block_shape_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    wo = load_model(write_compressed_tensors(demo_model_dir, tmp_path / "wo", "FP8_DYNAMIC", weights_only=True))
    assert wo.layers[0].mlp.gate_up_proj.method.scheme.activations == "none"
    # 128 x 128 blocks over the demo's 64-row k/v parts would straddle two parts of one fused matmul.
    with pytest.raises(ModelLoadError, match="multiple of 128 rows"):
        load_model(write_compressed_tensors(demo_model_dir, tmp_path / "bad", "FP8_BLOCK"))
    d = write_compressed_tensors(block_shape_dir, tmp_path / "blk", "FP8_BLOCK")
    model = load_model(d)
    gu = model.layers[1].mlp.gate_up_proj
    assert gu.method.scheme.weight_strategy == "block" and gu.weight_scale.shape == (6, 2)
    inter = model.cfg.intermediate_size
    for name, rows in (("gate_proj", (0, inter)), ("up_proj", (inter, 2 * inter))):
        torch.testing.assert_close(_ours(gu, rows), _library_dequantized(d, f"model.layers.1.mlp.{name}"),
                                   rtol=0, atol=0)


def test_hf_fp8_block_format(block_shape_dir, tmp_path):
    d = write_hf_fp8_block(block_shape_dir, tmp_path / "hf", not_converted=("model.layers.0.self_attn.o_proj",))
    model = load_model(d)
    assert isinstance(model.layers[0].self_attn.o_proj.method, UnquantizedLinearMethod)
    down = model.layers[1].mlp.down_proj
    assert down.method.scheme.scale_name == "weight_scale_inv"
    src = load_file(block_shape_dir / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    q, s = block_quantize(src)
    assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(down.weight_scale, s)
    # Within e4m3's rounding (2**-4 relative) of the float weights it came from.
    torch.testing.assert_close(_ours(down, (0, down.output_size)), src, rtol=2**-4, atol=1e-3)


def test_quantization_fp8_at_load_time(demo_model_dir):
    model = load_model(demo_model_dir, quantization="fp8")
    src = load_file(demo_model_dir / "model.safetensors")
    layer = model.layers[3].mlp.gate_up_proj
    inter = model.cfg.intermediate_size
    gate = src["model.layers.3.mlp.gate_proj.weight"]
    assert torch.equal(layer.weight_scale[:inter], gate.abs().amax(dim=1) / 448.0)
    torch.testing.assert_close(_ours(layer, (0, inter)), gate, rtol=2**-4,
                               atol=float(layer.weight_scale[:inter].max()) * 2**-9)  # e4m3's subnormal step
    assert model.lm_head.weight is model.embed_tokens.weight  # the tied head stays in the model's dtype


def test_broken_fp8_checkpoints_are_named(ct_dynamic, tmp_path):
    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(ct_dynamic, d)
        t = _file_tensors(d)
        cfg = json.loads((d / "config.json").read_text())
        edit(t, cfg)
        save_file(t, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    d = variant("noscale", lambda t, c: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(ModelLoadError, match="lacks weights for: layers.1.mlp.gate_up_proj.weight_scale"):
        load_model(d)
    d = variant("shape", lambda t, c: t.__setitem__("model.layers.0.self_attn.o_proj.weight_scale", torch.ones(3, 1)))
    with pytest.raises(ModelLoadError, match="o_proj.weight_scale.*shape"):
        load_model(d)
    d = variant("noconfig", lambda t, c: c.pop("quantization_config"))
    with pytest.raises(ModelLoadError, match="unexpected tensor.*weight_scale|is FP8"):
        load_model(d)
    d = variant("kvscale", lambda t, c: t.__setitem__("model.layers.0.self_attn.k_scale", torch.tensor(0.1)))
    with pytest.raises(ModelLoadError, match="k/v scales without a kv_cache_scheme"):
        load_model(d)
    d = variant("lmhead", lambda t, c: c["quantization_config"].__setitem__("ignore", []))
    with pytest.raises(ModelLoadError, match="quantized lm_head"):
        load_model(d)


def test_random_fp8_model_draws_the_bf16_models_weights():
    """Benchmarks compare bf16 and FP8 models of one shape: the FP8 one quantizes the very same draws."""
    from cluster.model.config import ModelArchConfig
    from cluster.model.loader import random_model

    arch = ModelArchConfig.from_dict({"model_type": "llama", "vocab_size": 96, "hidden_size": 64,
                                      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "max_position_embeddings": 64})
    ref = random_model(arch, torch.float32, "cpu", seed=5)
    fp8 = random_model(arch, torch.float32, "cpu", seed=5, quantization="fp8")
    for (name, a), (_, b) in zip(ref.named_modules(), fp8.named_modules()):
        if isinstance(b, torch.nn.Module) and hasattr(b, "method"):
            # e4m3: 2**-4 relative, and below its normal range steps of scale * 2**-9 (scale <= 0.01 here)
            torch.testing.assert_close(_ours(b, (0, b.output_size)), a.weight, rtol=2**-4, atol=0.01 * 2**-9)
    assert torch.equal(ref.lm_head.weight, fp8.lm_head.weight) and torch.equal(ref.norm.weight, fp8.norm.weight)
