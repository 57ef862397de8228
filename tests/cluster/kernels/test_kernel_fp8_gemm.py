"""Weight-only FP8 GEMM (split-K, per-channel and block scales) and per-token FP8 quantization against
their torch references (cluster/kernels/reference.py)."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import reference  # noqa: E402
from cluster.kernels.fp8_gemm import fp8_gemm, gemm_config, make_locks  # noqa: E402
from cluster.kernels.fp8_quant import quantize_per_token  # noqa: E402
from cluster.model.linear import quantize_weight_per_channel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n, k, block, gen, device):
    w = torch.randn(n, k, generator=gen) * k**-0.5
    if block is None:
        q, s = quantize_weight_per_channel(w)
    else:  # as a block-scaled checkpoint stores them: one scale per 128 x 128 tile
        nb, kb = -(-n // 128), -(-k // 128)
        pad = torch.zeros(nb * 128, kb * 128)
        pad[:n, :k] = w
        s = pad.view(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / 448 + 1e-12
        q = (w / s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.to(device), s.float().to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,block,bias", [
    (1, 96, 1200, None, False),  # split-K (5 splits), ragged N and K
    (3, 64, 1024, None, True),
    (20, 160, 384, None, False),  # BLOCK_M 32
    (70, 72, 136, None, True),  # above the GEMV rows: M tiles, no split
    (2, 200, 300, (128, 128), False),  # block scales, ragged at both ends
    (17, 256, 256, (128, 128), True),
])
def test_fp8_gemm_matches_reference(m, n, k, block, bias, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    w, s = _weights(n, k, block, gen, DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = (torch.randn(n, generator=gen) * 0.1).to(DEVICE, dtype) if bias else None
    locks = make_locks(n, DEVICE)
    want = reference.fp8_linear_weight_only(x, w, s, b, block)
    got = fp8_gemm(x, w, s, b, block, locks)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got, want, **tol)
    assert int(locks.abs().sum()) == 0  # the last split of every tile reset its counter
    # Launched again with the same locks (a graph replay): the same result, bit for bit.
    torch.testing.assert_close(fp8_gemm(x, w, s, b, block, locks), got, rtol=0, atol=0)


@pytest.mark.parametrize("m,n,k,block", [(1, 96, 1200, None), (3, 64, 1024, None), (20, 160, 384, None),
                                         (2, 200, 300, (128, 128))])
def test_the_shapes_above_take_the_split_k_path(m, n, k, block):
    assert gemm_config(m, n, k, block is not None, 8)["SPLIT_K"] > 1  # 8: the SM count assumed on CPU


def test_split_k_is_used_for_the_decode_shapes():
    h200 = 132
    for n, k in ((4096, 14336), (4096, 4096), (6144, 4096)):  # down, o, qkv of the 8B shape
        cfg = gemm_config(1, n, k, False, h200)
        assert cfg["SPLIT_K"] > 1 and cfg["k_per_split"] % cfg["BLOCK_K"] == 0
        assert cfg["SPLIT_K"] * cfg["k_per_split"] >= k > (cfg["SPLIT_K"] - 1) * cfg["k_per_split"]
    blk = gemm_config(1, 4096, 4096, True, h200)
    assert blk["k_per_split"] % 128 == 0 and blk["BLOCK_K"] <= 128  # never cuts a scale block
    assert gemm_config(256, 4096, 4096, False, h200)["SPLIT_K"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_per_token_matches_reference(dtype, static):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 300, generator=gen) * torch.logspace(-3, 2, 9)[:, None]).to(DEVICE, dtype)
    x[4] = 0  # an all-zero row: the floor scale, zeros out
    scale = torch.tensor([0.05], device=DEVICE) if static else None
    want_q, want_s = reference.quantize_per_token(x, scale)
    got_q, got_s = quantize_per_token(x, scale)
    assert got_s.shape == (9, 1)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0)
    # Bit-exact e4m3 (the interpreter's conversion is patched to round like the GPU's).
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    if static:  # values past the static scale's range saturate at +-448, never NaN
        assert not torch.isnan(got_q.float()).any()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])  # the 8B linears
@pytest.mark.parametrize("m", [1, 8, 33, 64, 256])
def test_fp8_gemm_llama_shapes_on_gpu(m, n, k):
    gen = torch.Generator().manual_seed(m + n)
    w, s = _weights(n, k, None, gen, "cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    want = reference.fp8_linear_weight_only(x, w, s, None)
    got = fp8_gemm(x, w, s, None, None, make_locks(n, "cuda"))
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
def test_w8a8_scaled_mm_matches_reference_on_gpu(static):
    from cluster.model.linear import fp8_linear_w8a8

    gen = torch.Generator().manual_seed(1)
    w, s = _weights(6144, 4096, None, gen, "cuda")
    x = torch.randn(300, 4096, generator=gen).to("cuda", torch.bfloat16)
    b = (torch.randn(6144, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    scale = torch.tensor([x.abs().max().item() / 448], device="cuda") if static else None
    want = reference.fp8_linear_w8a8(x, w, s, b, scale)
    got = fp8_linear_w8a8(x, w, s, b, scale)
    # FP8 tensor cores accumulate in reduced precision; bias added after the bf16 rounding.
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.gpu
def test_both_fp8_paths_replay_in_a_cuda_graph():
    """Weight-only split-K (its locks reset themselves between replays) and W8A8, captured once and
    replayed on new inputs: the same results as eager calls."""
    from cluster.model.linear import fp8_linear_w8a8, fp8_linear_weight_only

    gen = torch.Generator().manual_seed(2)
    w, s = _weights(4096, 14336, None, gen, "cuda")
    locks = make_locks(4096, "cuda")
    small = torch.randn(4, 14336, generator=gen).to("cuda", torch.bfloat16)
    large = torch.randn(128, 14336, generator=gen).to("cuda", torch.bfloat16)
    fp8_linear_weight_only(small, w, s, None, None, locks)  # compile outside the capture
    fp8_linear_w8a8(large, w, s, None)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_small = fp8_linear_weight_only(small, w, s, None, None, locks)
        out_large = fp8_linear_w8a8(large, w, s, None)
    for _ in range(3):
        small.copy_(torch.randn(small.shape, generator=gen).to("cuda", torch.bfloat16))
        large.copy_(torch.randn(large.shape, generator=gen).to("cuda", torch.bfloat16))
        g.replay()
        torch.testing.assert_close(out_small, fp8_linear_weight_only(small, w, s, None, None, locks), rtol=0, atol=0)
        torch.testing.assert_close(out_large, fp8_linear_w8a8(large, w, s, None), rtol=0, atol=0)
    assert int(locks.abs().sum()) == 0
