"""Weight-only FP8 GEMM/GEMV: y = x W^T (+ b) with W in e4m3, x in bf16 (or fp16/fp32), one Triton kernel.

Must equal `cluster.kernels.reference.fp8_linear_weight_only`: the e4m3 weight tile is widened to x's
dtype in registers (exact), multiplied on the tensor cores with float32 accumulation, and the scale
is applied to the float32 sum (per output channel once at the end; per 128 x 128 block to each
block's partial sum), the bias added in float32, one rounding to x's dtype. The reference multiplies
the scales in before its float32 matmul: equal up to float32 rounding.

Decode is memory-bound: at batch 1 the step reads every weight once, so what matters is reading the
e4m3 bytes at HBM speed (half of bf16's). A program owns BLOCK_N output channels of BLOCK_M rows and a
slice of K (split-K): with few output tiles (o_proj, down_proj: N = 4096) one program per tile would
leave most SMs idle, so K is split until the grid covers the SMs a few times over. Each split writes
its float32 partial tile to a workspace and counts itself in the tile's lock; the last one to arrive
sums the partials in split order (deterministic) and writes the output, then resets the lock to 0,
so the locks are zero between launches and no memset runs per call (one kernel per linear, nothing
to sync: CUDA-graph capturable). Rows past FP8_GEMV_MAX_M go to torch._scaled_mm instead when the
activations may be quantized (cluster/model/linear.py); block-scaled weights use this kernel at any M.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 128  # rows and columns of a block-scaled checkpoint's scale block
_MIN_BLOCK_N = 32
_SPLIT_WAVES = 4  # split K until the grid holds about this many programs per SM


@triton.jit
def _fp8_gemm_kernel(
    X, W, S, Bias, Out, Part, Locks,
    M, N, K, stride_xm, stride_wn, stride_om, stride_s, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_SCALED: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
):
    DT: tl.constexpr = X.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptr = X + rm[:, None].to(tl.int64) * stride_xm + (k_lo + rk)[None, :]
    w_ptr = W + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k + rk) < k_hi
        x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(DT)  # e4m3 -> DT: exact
        if IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w))
        if BLOCK_SCALED:  # BLOCK_K divides SB and k_per_split is a multiple of SB: one scale column per tile
            s = tl.load(S + (rn // SB).to(tl.int64) * stride_s + k // SB, mask=n_ok, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if not BLOCK_SCALED:  # per-channel scale: the sums are linear in it, so partial sums may take it
        acc = acc * tl.load(S + rn, mask=n_ok, other=0.0)[None, :]

    out_ptr = Out + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        part_ptr = Part + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + pid_k * M * N, acc, mask=mask)
        # NOTE: every thread's partial must be visible before the count: barrier, then a gpu-scope
        # acq_rel atomic (release our stores; the last arriver acquires everyone's).
        tl.debug_barrier()
        arrived = tl.atomic_add(Locks + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # split order, whichever program arrives last: deterministic
                total += tl.load(part_ptr + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr, total.to(Out.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Locks + tile, 0)  # ready for the next launch


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def gemm_config(m: int, n: int, k: int, block_scaled: bool, num_sms: int) -> dict:
    """Tiles, split count and pipeline depth for one shape (host-side: static per CUDA-graph bucket)."""
    # Chosen from the sm_90 resource reports (tests/cluster/kernels/sm90_compile.py): the largest tiles
    # whose e4m3 -> bf16 widening stays in registers (BLOCK_N 128, or BLOCK_M 128, spill).
    if m <= 16:
        bm, bn, bk, stages, warps = 16, 64, 256, 4, 8
    elif m <= 32:
        bm, bn, bk, stages, warps = 32, 64, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, stages, warps = 64, 64, 128, 4, 8
    else:
        bm, bn, bk, stages, warps = 64, 64, 128, 3, 8
    if block_scaled:
        bk = min(bk, SCALE_BLOCK)
    n_tiles, m_tiles = triton.cdiv(n, bn), triton.cdiv(m, bm)
    split = 1
    if m_tiles == 1:  # split-K for the small-batch GEMV shapes only
        want = -(-_SPLIT_WAVES * num_sms // n_tiles)
        unit = SCALE_BLOCK if block_scaled else bk  # a split never cuts a scale block
        split = max(1, min(want, triton.cdiv(k, unit)))
        per = triton.cdiv(triton.cdiv(k, split), unit) * unit
        split = triton.cdiv(k, per)
    else:
        per = triton.cdiv(k, bk) * bk
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, k_per_split=per, num_stages=stages,
                num_warps=warps, n_tiles=n_tiles, m_tiles=m_tiles)


def make_locks(n: int, device: torch.device | str) -> torch.Tensor:
    """The per-layer lock counters (zeros; the kernel leaves them zero), one per output tile."""
    return torch.zeros(triton.cdiv(n, _MIN_BLOCK_N), dtype=torch.int32, device=device)


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32, rows contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32, or [ceil(N / 128), ceil(K / 128)] float32 with block
    bias: torch.Tensor | None = None,  # [N], x's dtype
    block: tuple[int, int] | None = None,  # (128, 128) for block-scaled weights
    locks: torch.Tensor | None = None,  # make_locks(N), kept by the layer; allocated here if None
) -> torch.Tensor:  # [M, N], x's dtype
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == torch.float8_e4m3fn and x.stride(1) == 1 and weight.stride(1) == 1
    assert block is None or tuple(block) == (SCALE_BLOCK, SCALE_BLOCK)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = gemm_config(m, n, k, block is not None, _num_sms(x.device))
    split = cfg["SPLIT_K"]
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        if locks is None:
            locks = make_locks(n, x.device)
        assert locks.numel() >= cfg["n_tiles"] * cfg["m_tiles"]
    else:
        part = locks = out  # unused
    _fp8_gemm_kernel[(cfg["n_tiles"], cfg["m_tiles"], split)](
        x, weight, scale, bias if bias is not None else out, out, part, locks,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), scale.stride(0) if block is not None else 0,
        cfg["k_per_split"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split,
        BLOCK_SCALED=block is not None, SB=SCALE_BLOCK, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
