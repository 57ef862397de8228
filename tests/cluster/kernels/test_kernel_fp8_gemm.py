"""FP8 GEMMs (weight-only and W8A8; split-K, per-channel and block scales), per-token FP8 quantization
and the tuned-config table, against their torch references (cluster/kernels/reference.py)."""

import json

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import fp8_gemm_configs, reference  # noqa: E402
from cluster.kernels.fp8_gemm import fp8_gemm, fp8_gemm_w8a8, make_locks, split_plan  # noqa: E402
from cluster.kernels.fp8_gemm_configs import MAX_SPLIT_M_TILES, GemmConfig, default_config  # noqa: E402
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


def _tol(dtype):
    # float32: accumulation order; otherwise one rounding of the output to the activation dtype.
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)


def _w8a8_tol(dtype):
    # Hopper's e4m3 x e4m3 tensor-core MMA does not accumulate in IEEE float32 (about 14 mantissa
    # bits inside one MMA chain; the kernel promotes to float32 every BLOCK_K): on the GPU a float32
    # output carries that error (seen: 5e-4..1e-3 absolute at K = 384..1024). The interpreter
    # accumulates in float32 exactly.
    if dtype == torch.float32 and DEVICE == "cuda":
        return dict(rtol=4e-3, atol=4e-3)
    return _tol(dtype)


CASES = [  # m, n, k, block, bias, config (block_m, block_n, block_k, split_k, warps, stages)
    (1, 96, 1200, None, False, GemmConfig(16, 32, 64, 5, 4, 2)),  # split-K, ragged N and K (K % BLOCK_K != 0)
    (3, 64, 1024, None, True, GemmConfig(16, 64, 128, 8, 4, 2)),  # one step per split
    (20, 160, 384, None, False, GemmConfig(32, 64, 128, 2, 4, 2)),  # two M tiles... of 32: one
    (70, 72, 136, None, True, GemmConfig(16, 16, 32, 3, 4, 1)),  # 5 M tiles: more than MAX_SPLIT_M_TILES, no split
    (40, 48, 256, None, False, GemmConfig(16, 16, 64, 2, 4, 2)),  # 3 M tiles, split-K: the locks of every tile
    (2, 200, 300, (128, 128), False, GemmConfig(16, 64, 64, 3, 4, 2)),  # block scales, ragged at both ends
    (17, 256, 256, (128, 128), True, GemmConfig(32, 128, 128, 1, 4, 2)),
    (5, 80, 512, None, False, None),  # the default config (no table on CPU)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,block,bias,config", CASES)
def test_weight_only_matches_reference(m, n, k, block, bias, config, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    w, s = _weights(n, k, block, gen, DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = (torch.randn(n, generator=gen) * 0.1).to(DEVICE, dtype) if bias else None
    locks = make_locks(n, DEVICE)
    want = reference.fp8_linear_weight_only(x, w, s, b, block)
    got = fp8_gemm(x, w, s, b, block, locks, config)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert int(locks.abs().sum()) == 0  # the last split of every tile reset its counter
    # Launched again with the same locks (a graph replay): the same result, bit for bit.
    torch.testing.assert_close(fp8_gemm(x, w, s, b, block, locks, config), got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,block,bias,config", [c for c in CASES if c[3] is None])
def test_w8a8_matches_reference(m, n, k, block, bias, config, dtype):
    gen = torch.Generator().manual_seed(m * n + k + 1)
    w, s = _weights(n, k, None, gen, DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = (torch.randn(n, generator=gen) * 0.1).to(DEVICE, dtype) if bias else None
    locks = make_locks(n, DEVICE)
    xq, xs = quantize_per_token(x)
    want = reference.fp8_linear_w8a8(x, w, s, b)
    got = fp8_gemm_w8a8(xq, xs, w, s, b, dtype, locks, config)
    torch.testing.assert_close(got, want, **_w8a8_tol(dtype))
    assert int(locks.abs().sum()) == 0
    torch.testing.assert_close(fp8_gemm_w8a8(xq, xs, w, s, b, dtype, locks, config), got, rtol=0, atol=0)


def test_split_plan_uses_whole_steps_and_no_empty_split():
    cfg = GemmConfig(16, 128, 128, 9, 4, 4)
    for k in (4096, 14336, 1200, 128, 200):
        split, per = split_plan(1, 4096, k, cfg, False)
        assert per % 128 == 0 and split * per >= k > (split - 1) * per and split <= 9
    assert split_plan(1, 4096, 4096, GemmConfig(16, 128, 64, 8, 4, 4), True)[1] % 128 == 0  # whole scale blocks
    rows = 16 * MAX_SPLIT_M_TILES
    assert split_plan(rows, 4096, 4096, cfg, False)[0] > 1
    assert split_plan(rows + 1, 4096, 4096, cfg, False) == (1, 4096)  # past the locks' tiles: no split


def test_default_config_splits_the_decode_shapes_on_an_h200():
    for n, k in ((4096, 14336), (4096, 4096), (6144, 4096), (2048, 2048), (3072, 2048)):  # 8B / 1B down, o, qkv
        for w8a8 in (False, True):
            cfg = default_config(1, n, k, w8a8, False, 132)
            split, per = split_plan(1, n, k, cfg, False)
            assert split > 1 and -(-n // cfg.block_n) * split >= 132  # the grid covers the SMs
            assert per >= 2 * cfg.block_k  # at least two steps a split
    assert default_config(256, 4096, 4096, True, False, 132).block_m == 128
    assert default_config(256, 4096, 4096, False, False, 132).block_m == 64  # weight-only's largest tile


def _emulate_widen(codes: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    """fp8_gemm._WIDEN_BF16 / _WIDEN_F16, instruction by instruction, on pairs of e4m3 codes (int64)."""
    b0, b1 = codes[0::2], codes[1::2]
    sign0 = torch.where(b0 >= 128, 0xFF, 0)
    t = (b1 << 24) | (sign0 << 16) | (b0 << 8)  # prmt.b32 t, $1, 0, 0x1804
    t = torch.where(t >= 2**31, t - 2**32, t)  # as a signed 32-bit value
    shift, mask, bias = (4, 0x87F087F0, 2.0**120) if to == torch.bfloat16 else (1, 0xBF80BF80, 2.0**8)
    t = (t >> shift) & mask  # shr.s32 (arithmetic), and.b32
    lanes = torch.stack([t & 0xFFFF, t >> 16], dim=1).flatten().to(torch.int32).to(torch.int16)
    return lanes.view(to).double() * bias  # the multiply by a power of two is exact


@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16])
def test_the_fast_widening_is_exact_for_every_code(to):
    """The inline assembly runs on GPUs only (the GPU test below runs it); this checks its arithmetic on
    all 254 finite e4m3 codes, subnormals and both zeros included."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.int64)
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    got = _emulate_widen(codes, to)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 stays negative


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


# -- the tuned table ----------------------------------------------------------------------------------
def _entry(n, k, m, path, w8a8=True):
    cfg = GemmConfig(16, 128, 128, 4, 4, 4).to_json()
    return {"N": n, "K": k, "M": m, "path": path, "weight_only": cfg, "w8a8": cfg if w8a8 else None}


def test_the_table_is_read_by_shape_and_bucket_on_its_architecture(tmp_path, monkeypatch):
    table = {"capability": [9, 0], "entries": [_entry(4096, 4096, 8, "w8a8"), _entry(4096, 4096, 1, "weight_only")]}
    path = tmp_path / "fp8_gemm_configs.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(fp8_gemm_configs, "TABLE_PATH", path)
    fp8_gemm_configs._table.cache_clear()
    monkeypatch.setattr(fp8_gemm_configs, "_capability", lambda device: (9, 0))
    try:
        assert fp8_gemm_configs.tuned_path(4096, 4096, 5, torch.device("cpu")) == "w8a8"  # 5 rows: bucket 8
        assert fp8_gemm_configs.tuned_path(4096, 4096, 1, torch.device("cpu")) == "weight_only"
        assert fp8_gemm_configs.tuned_path(4096, 4096, 9, torch.device("cpu")) is None  # bucket 16: not measured
        assert fp8_gemm_configs.tuned_path(4096, 4096, 257, torch.device("cpu")) is None  # past the buckets
        cfg = fp8_gemm_configs.tuned_or_default(7, 4096, 4096, True, False, torch.device("cpu"))
        assert cfg == GemmConfig(16, 128, 128, 4, 4, 4)
        monkeypatch.setattr(fp8_gemm_configs, "_capability", lambda device: (8, 0))  # another architecture
        assert fp8_gemm_configs.tuned_path(4096, 4096, 1, torch.device("cpu")) is None
    finally:
        fp8_gemm_configs._table.cache_clear()


def test_a_bad_table_entry_is_an_error():
    with pytest.raises(ValueError, match="unknown path"):
        fp8_gemm_configs.parse_table({"entries": [_entry(64, 64, 1, "magic")]})
    with pytest.raises(ValueError, match="not a bucket"):
        fp8_gemm_configs.parse_table({"entries": [_entry(64, 64, 3, "weight_only")]})
    with pytest.raises(ValueError, match="without its config"):
        fp8_gemm_configs.parse_table({"entries": [_entry(64, 64, 1, "w8a8", w8a8=False)]})


def test_the_committed_table_parses():
    data = json.loads(fp8_gemm_configs.TABLE_PATH.read_text())
    fp8_gemm_configs.parse_table(data)


# -- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048)])
@pytest.mark.parametrize("m", [1, 8, 33, 64, 256])
def test_both_kernels_at_the_llama_shapes_on_gpu(m, n, k):
    gen = torch.Generator().manual_seed(m + n)
    w, s = _weights(n, k, None, gen, "cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    want = reference.fp8_linear_weight_only(x, w, s, None)
    got = fp8_gemm(x, w, s, None, None, make_locks(n, "cuda"))
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 2e-3  # bf16 output rounding (~1e-3 would be every element off by half a step)
    xq, xs = quantize_per_token(x)
    want = reference.fp8_linear_w8a8(x, w, s, None)
    got = fp8_gemm_w8a8(xq, xs, w, s, None, torch.bfloat16, make_locks(n, "cuda"))
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fast_widening_on_gpu_is_exact_for_every_code(dtype):
    """Every finite e4m3 code through the inline-assembly widening: out[m, n] = W[n, m] * 1.0 exactly."""
    n = k = 256
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 256
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    x = torch.eye(k, dtype=dtype, device="cuda")[:16]
    got = fp8_gemm(x, w, torch.ones(n, device="cuda"), None, None, make_locks(n, "cuda"),
                   GemmConfig(16, 64, 128, 1, 4, 2))
    want = w.float().t()[:16].to(dtype)
    assert torch.equal(got, want)  # values (a -0.0 weight sums to +0.0 with the other rows' zeros)


@pytest.mark.gpu
def test_every_fp8_path_replays_in_a_cuda_graph():
    """Weight-only and the Triton W8A8 kernel with split-K (their locks reset themselves between
    replays) and _scaled_mm, captured once and replayed on new inputs: the same results as eager calls."""
    from cluster.model.linear import fp8_linear_w8a8, fp8_linear_weight_only

    gen = torch.Generator().manual_seed(2)
    w, s = _weights(4096, 14336, None, gen, "cuda")
    locks = [make_locks(4096, "cuda") for _ in range(2)]
    small = torch.randn(4, 14336, generator=gen).to("cuda", torch.bfloat16)
    large = torch.randn(128, 14336, generator=gen).to("cuda", torch.bfloat16)
    split = GemmConfig(16, 128, 128, 8, 4, 4)
    calls = [lambda: fp8_linear_weight_only(small, w, s, None, None, locks[0], split),
             lambda: fp8_linear_w8a8(small, w, s, None, None, False, locks[1], split),
             lambda: fp8_linear_w8a8(large, w, s, None)]
    for c in calls:  # compile outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [c() for c in calls]
    for _ in range(3):
        small.copy_(torch.randn(small.shape, generator=gen).to("cuda", torch.bfloat16))
        large.copy_(torch.randn(large.shape, generator=gen).to("cuda", torch.bfloat16))
        g.replay()
        for out, c in zip(outs, calls):
            torch.testing.assert_close(out, c(), rtol=0, atol=0)
    assert all(int(lk.abs().sum()) == 0 for lk in locks)
