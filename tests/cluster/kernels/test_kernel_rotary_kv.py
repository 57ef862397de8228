"""Rotary + paged KV write kernel against its torch reference (the model's CPU path)."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import reference  # noqa: E402
from cluster.kernels.rotary_kv import rotary_store_kv  # noqa: E402
from cluster.model.config import ModelArchConfig  # noqa: E402
from cluster.model.rope import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _table(head_dim, dtype, device):
    cfg = ModelArchConfig(model_type="llama", vocab_size=10, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
                          max_position_embeddings=8192, rope_theta=500000.0,
                          rope_scaling=(("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
                                        ("high_freq_factor", 4.0), ("original_max_position_embeddings", 1024)))
    rope = RotaryEmbedding(cfg)
    rope.build_tables(device, dtype)
    return rope.cos_sin


def _check(tokens, heads, kv_heads, head_dim, dtype, device, seed, kv_dtype=None, scales=(1.0, 1.0)):
    g = torch.Generator().manual_seed(seed)
    num_blocks, page = 2 + -(-tokens // 16) * 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(device=device, dtype=dtype)
    positions = torch.randint(0, 8192, (tokens,), generator=g).to(device)
    slots = (torch.randperm(num_blocks * page, generator=g)[:tokens]).to(device)
    table = _table(head_dim, dtype, device)
    want_kv = torch.full((2, num_blocks, page, kv_heads, head_dim), float("nan"), dtype=kv_dtype or dtype,
                         device=device)
    got_kv = want_kv.clone()
    wq, wk, wv = reference.rotary_store_kv(qkv.clone(), positions, table, want_kv, slots, heads, kv_heads, head_dim,
                                           *scales)
    buf = qkv.clone()
    q, k, v = rotary_store_kv(buf, positions, table, got_kv, slots, heads, kv_heads, head_dim, *scales)
    assert q.data_ptr() == buf.data_ptr()  # views of the fused row, rotated in place
    # Bit-exact in every dtype, on the GPU and under the interpreter (whose float32 -> bfloat16 cast
    # tests/triton_interpreter.py makes round to nearest even, as the GPU's): the kernel rounds each
    # product and the sum to the activation dtype where torch does, with FP fusion off (rotary_kv.py).
    for got, want in ((q, wq), (k, wk), (v, wv)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    written = torch.zeros(num_blocks * page, dtype=torch.bool, device=device)
    written[slots] = True
    for c in (got_kv, want_kv):  # the other slots are still poisoned
        assert torch.isnan(c.flatten(1, 2)[:, ~written].float()).all()
    got_w, want_w = got_kv.flatten(1, 2)[:, written], want_kv.flatten(1, 2)[:, written]
    if kv_dtype == torch.float8_e4m3fn:
        # The same k and v, divided by the scale once (IEEE, both sides), rounded to nearest even: the
        # same e4m3 bytes, signed zeros and subnormals included.
        assert not torch.isnan(got_w.float()).any()
        assert torch.equal(got_w.view(torch.uint8), want_w.view(torch.uint8))
    else:
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 4, 16), (7, 6, 2, 32), (13, 12, 3, 16), (5, 8, 1, 32)])
def test_matches_reference(tokens, heads, kv_heads, head_dim, dtype):
    _check(tokens, heads, kv_heads, head_dim, dtype, DEVICE, seed=tokens * heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.3, 2.5)])
def test_fp8_cache_matches_reference(dtype, scales):
    """An e4m3 cache holds e4m3(clamp(k / k_scale)), e4m3(clamp(v / v_scale)); q, k, v returned unquantized."""
    _check(9, 6, 2, 32, dtype, DEVICE, seed=5, kv_dtype=torch.float8_e4m3fn, scales=scales)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", [(0.05, 0.02), (0.3, 0.07)])  # the second: 1 / scale is inexact in float32
@pytest.mark.parametrize("tokens", [1, 64, 2049])
def test_fp8_cache_matches_reference_on_gpu(tokens, scales):
    """Bit-exact e4m3 bytes (the H200 run before FP fusion was turned off: 0.1% one e4m3 step apart)."""
    _check(tokens, 32, 8, 128, torch.bfloat16, "cuda", seed=tokens, kv_dtype=torch.float8_e4m3fn, scales=scales)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 8, 64), (28, 4, 128), (16, 16, 64), (32, 4, 128)])
@pytest.mark.parametrize("tokens", [1, 64, 2049])
def test_matches_reference_on_gpu(tokens, heads, kv_heads, head_dim):
    _check(tokens, heads, kv_heads, head_dim, torch.bfloat16, "cuda", seed=tokens + heads)
