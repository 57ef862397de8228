"""Greedy output of FP8 models through LLMEngine equals a from-scratch reference of the same FP8 math:
Hugging Face's model with the dequantized weights, and each linear's input quantized per token (e4m3,
amax / 448 per row) where pdserve runs W8A8. Written here without pdserve's FP8 code, so the engine's
loader, fused layers, dispatch and scales are all checked. Also: an FP8 KV cache, and the pool sizing."""

import json

import pytest
import torch
from fp8_checkpoints import write_compressed_tensors
from safetensors.torch import load_file

from cluster.engine.engine import LLMEngine
from cluster.model import linear
from cluster.sampling.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["Once upon a time there was a little", "The cat sat on the mat and looked at the",
           "In the beginning the sun rose over the hills and"]
THRESHOLD = 8  # rows above which the engine runs W8A8 in this test (prefill); decode batches stay below


def _e4m3(x):
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def _hf_reference(src_dir, weights: dict[str, torch.Tensor], w8a8_above: int | None):
    """HF Llama from src_dir with `weights` (name -> float32 dequantized) swapped in; with w8a8_above,
    every decoder linear's input of more than that many rows is fake-quantized per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in weights.items():
            model.get_parameter(name).copy_(w)

    def fake_quant(module, args):
        x = args[0]
        if x.shape[-2] <= w8a8_above:
            return None
        scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1.0 / (448 * 512))
        return (_e4m3(x / scale) * scale,)

    if w8a8_above is not None:
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and "lm_head" not in name:
                m.register_forward_pre_hook(fake_quant)
    return model


def _hf_greedy(model, tokenizer, prompt, n):
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=2)
    return tuple(out[0, ids.shape[1]:].tolist())


def _engine_greedy(model_dir, **kw):
    engine = LLMEngine(model_dir, num_blocks=256, **kw)
    return engine, [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture
def w8a8_prefill(monkeypatch):
    monkeypatch.setattr(linear, "FP8_GEMV_MAX_M", THRESHOLD)


def test_compressed_tensors_fp8_dynamic_greedy_equals_the_reference(demo_model_dir, tmp_path, w8a8_prefill):
    pytest.importorskip("compressed_tensors")
    d = write_compressed_tensors(demo_model_dir, tmp_path / "ct", "FP8_DYNAMIC")
    engine, got = _engine_greedy(d)
    assert all(len(engine.tokenizer.encode(p)) > THRESHOLD for p in PROMPTS)  # prefill took the W8A8 path
    t = load_file(d / "model.safetensors")
    weights = {n.replace("weight_scale", "weight"): t[n.replace("weight_scale", "weight")].float() * t[n].float()
               for n in t if n.endswith("weight_scale")}
    ref = _hf_reference(demo_model_dir, weights, THRESHOLD)
    want = [_hf_greedy(ref, engine.tokenizer, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got == want


def test_quantization_fp8_greedy_equals_the_reference(demo_model_dir, w8a8_prefill):
    engine, got = _engine_greedy(demo_model_dir, quantization="fp8")
    src = load_file(demo_model_dir / "model.safetensors")
    weights = {}
    for n, w in src.items():
        if n.endswith("proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # per output channel
            weights[n] = _e4m3(w / scale) * scale
    ref = _hf_reference(demo_model_dir, weights, THRESHOLD)
    want = [_hf_greedy(ref, engine.tokenizer, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got == want
    # The FP8 model is not the float one: some of its weights moved (a check that quantization ran).
    assert any(not torch.equal(weights[n], src[n]) for n in weights)


def test_fp8_kv_cache_greedy_equals_the_reference(demo_model_dir, monkeypatch):
    """An e4m3 cache (scale 1.0: the demo carries no k/v scales): half the bytes per block of a bf16
    cache (a quarter of this float32 demo's), and greedy output equal to HF's attention over K (after
    rotary) and V rounded to e4m3, prefill included (pdserve's prefill reads the new tokens' K/V back
    from the cache)."""
    from transformers.models.llama import modeling_llama

    engine, got = _engine_greedy(demo_model_dir, kv_cache_dtype="fp8")
    base = LLMEngine(demo_model_dir, num_blocks=8)
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert engine.spec.bytes_per_block * 4 == base.spec.bytes_per_block
    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_e4m3_k(q, k, *args, **kw):
        q, k = rotary(q, k, *args, **kw)
        return q, _e4m3(k)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary_then_e4m3_k)
    ref = _hf_reference(demo_model_dir, {}, None)
    for layer in ref.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda m, args, out: _e4m3(out))
    want = [_hf_greedy(ref, engine.tokenizer, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got == want
    with pytest.raises(Exception, match="unsupported kv_cache_dtype 'int8'"):
        LLMEngine(demo_model_dir, num_blocks=8, kv_cache_dtype="int8")


def test_kv_pool_doubles_with_fp8_against_bf16():
    from cluster.kv.kv_cache import DeviceMemory, kv_pool_blocks
    from cluster.model.config import ModelArchConfig
    from cluster.worker.worker_config import WorkerConfig

    arch = ModelArchConfig.from_dict({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                                      "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                      "num_key_value_heads": 8})
    mem = DeviceMemory(total=140 << 30, free=120 << 30, reserved_here=16 << 30)
    cfg = WorkerConfig(model_dir="x", device="cuda")
    bf16 = kv_pool_blocks(cfg, arch, torch.bfloat16, torch.device("cuda"), mem)
    fp8 = kv_pool_blocks(cfg, arch, torch.bfloat16, torch.device("cuda"), mem, kv_dtype=torch.float8_e4m3fn)
    assert fp8 - 1 == 2 * (bf16 - 1) or fp8 - 1 == 2 * (bf16 - 1) + 1  # NULL block aside, twice the blocks


def test_prefix_cache_salt_separates_numerics(demo_model_dir):
    """A float and an FP8 engine over one checkpoint must not take each other's cached blocks."""
    from cluster.kv.kv_cache import kv_numerics_tag

    assert kv_numerics_tag(torch.float32, "none", torch.float32) == "torch.float32"  # as before FP8
    tags = {kv_numerics_tag(torch.bfloat16, q, kv) for q in ("none", "fp8:channel/dynamic")
            for kv in (torch.bfloat16, torch.float8_e4m3fn)}
    assert len(tags) == 4
    assert json.loads((demo_model_dir / "config.json").read_text())  # the salt also hashes the config
