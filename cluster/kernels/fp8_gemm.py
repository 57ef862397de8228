"""FP8 GEMMs: y = x W^T (+ b) with W in e4m3, two Triton kernels sharing one split-K epilogue.

- `fp8_gemm` (weight-only): x in bf16 / fp16 / fp32. Must equal
  `reference.fp8_linear_weight_only`: the e4m3 tile is widened to x's dtype in registers (exact), the
  product accumulated in float32 on the tensor cores, the scale applied to the float32 sum (per output
  channel once at the end; per 128 x 128 block to each block's partial sum), the bias added in
  float32, one rounding to x's dtype. The reference multiplies the scales in before its float32
  matmul: equal up to float32 rounding.
- `fp8_gemm_w8a8`: x already quantized per token (`fp8_quant.quantize_per_token`: e4m3 rows and their
  float32 scales), e4m3 x e4m3 on the FP8 tensor cores, both scales and the bias applied to the float32
  sum. Must equal `reference.fp8_linear_w8a8` up to float32 rounding: the FP8 tensor cores keep fewer
  than 32 bits while they accumulate, so each BLOCK_K step's sum is added to a float32 accumulator
  (`max_num_imprecise_acc`), as cuBLASLt does without fast accumulation.

Decode is memory-bound: at batch 1 a step reads every weight once, so what matters is streaming the
e4m3 bytes at HBM speed. Both kernels compute out^T = W x^T ("swap AB"): the weight tile is the MMA's
left operand (wgmma's M = 64 weight rows per warpgroup) and the few tokens its N (padded to 16), so a
batch of 1..64 costs the tensor cores next to nothing; what is left per weight byte is its widening.
Triton's own e4m3 -> bf16 goes through f16 (cvt e4m3x2 -> f16x2, then a cvt f16 -> bf16 per element:
1.5 instructions a byte, all on the conversion unit); `widen_e4m3` takes three integer ops and one
multiply per two elements instead (2 a byte, on the integer and FMA pipes; sm_90 SASS: PRMT, SHF,
LOP3, HMUL2 after one LDS.U16 per pair). FAST_DEQUANT is CUDA only: Triton's interpreter runs no inline
assembly, and takes `.to()`, which is exact too.

A program owns BLOCK_N output channels of BLOCK_M rows and a slice of K. With few output tiles (o_proj,
down_proj: N = 4096) one program per tile would leave most SMs idle, so K is split (the config's
split_k, from the tuned table in fp8_gemm_configs.py). Each split writes its float32 partial tile to a
workspace and counts itself in the tile's lock; the last to arrive sums the partials in split order
(deterministic, whichever arrives last) and writes the output, then resets the lock to 0, so the
locks are zero between launches: no memset and no second kernel per call, nothing to sync, CUDA-graph
capturable (one kernel per linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels import fp8_gemm_configs
from cluster.kernels.fp8_gemm_configs import MAX_SPLIT_M_TILES, SCALE_BLOCK, GemmConfig

_MIN_BLOCK_N = 16

# e4m3 -> bf16 (or f16) for two elements packed in the low half of $1. prmt builds [b1, sign(b0) x 8, b0, 0];
# an arithmetic shift right then puts each byte's exponent and mantissa under the 16-bit type's (4 bits
# for bf16, 1 for f16), each lane's top bits holding copies of its sign, which the mask keeps once: the
# bit pattern of value * 2^-120 (bf16) or * 2^-8 (f16), subnormals included; the multiply by the power
# of two is exact. (The NaN codes 0x7f / 0xff would come out as +-480; quantized weights never hold them.)
_WIDEN_BF16 = tl.constexpr("""{
.reg .b32 t, c, z;
prmt.b32 t, $1, 0, 0x1804;
shr.s32 t, t, 4;
and.b32 t, t, 0x87F087F0;
mov.b32 c, 0x7B807B80;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, t, c, z;
}""")
_WIDEN_F16 = tl.constexpr("""{
.reg .b32 t, c;
prmt.b32 t, $1, 0, 0x1804;
shr.s32 t, t, 1;
and.b32 t, t, 0xBF80BF80;
mov.b32 c, 0x5C005C00;
mul.rn.f16x2 $0, t, c;
}""")


@triton.jit
def widen_e4m3(w, DT: tl.constexpr, FAST: tl.constexpr):
    """e4m3 -> DT, exactly (FAST: the inline-PTX trick below for bf16 / f16; CUDA only). Also the FP8 KV
    cache's widening in cluster/attention/triton_decode.py."""
    if FAST and DT == tl.bfloat16:
        return tl.inline_asm_elementwise(_WIDEN_BF16, "=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    elif FAST and DT == tl.float16:
        return tl.inline_asm_elementwise(_WIDEN_F16, "=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                         is_pure=True, pack=2)
    else:
        return w.to(DT)


@triton.jit
def _split_k_epilogue(acc, Out, Part, Locks, Bias, rn, rm, N, M, stride_om, split_k, HAS_BIAS: tl.constexpr):
    """acc: this program's float32 [BLOCK_N, BLOCK_M] tile of out^T, scales applied. With one split it is
    the output; with more, the last split of the tile to finish sums every split's partial."""
    n_ok = rn < N
    m_ok = rm < M
    mask = n_ok[:, None] & m_ok[None, :]
    out_ptr = Out + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    if split_k == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=mask)
    else:
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        part_ptr = Part + rm[None, :].to(tl.int64) * N + rn[:, None]
        plane = M.to(tl.int64) * N
        tl.store(part_ptr + tl.program_id(1) * plane, acc, mask=mask)
        # NOTE: every thread's partial must be visible before the count: barrier, then a gpu-scope
        # acq_rel atomic (release our stores; the last arriver acquires everyone's).
        tl.debug_barrier()
        arrived = tl.atomic_add(Locks + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(split_k):  # split order, whichever program arrives last: deterministic
                total += tl.load(part_ptr + s * plane, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr, total.to(Out.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Locks + tile, 0)  # ready for the next launch


# NOTE: M and split_k are not specialized (a value of 1 would otherwise compile another kernel): one
# compile per tile config serves every batch size and split, which keeps graph capture and the tuner fast.
@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_gemm_kernel(
    X, W, S, Bias, Out, Part, Locks,
    M, N, K, stride_xm, stride_wn, stride_om, stride_s, k_per_split, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_SCALED: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_DEQUANT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Weight-only: grid (N tiles, splits, M tiles)."""
    DT: tl.constexpr = X.dtype.element_ty
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rn_in = tl.minimum(rn, N - 1)  # rows past N read row N - 1 (never stored): no mask in the loop
    m_ok = rm < M
    w_ptr = W + rn_in[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptr = X + rm[None, :].to(tl.int64) * stride_xm + (k_lo + rk)[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr)
            x = tl.load(x_ptr, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptr, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        a = widen_e4m3(w, DT, FAST_DEQUANT)
        if BLOCK_SCALED:  # BLOCK_K divides SB and k_per_split is a multiple of SB: one scale column a step
            s = tl.load(S + (rn_in // SB).to(tl.int64) * stride_s + k // SB)
            if IEEE:
                acc += tl.dot(a, x, input_precision="ieee") * s[:, None]
            else:
                acc += tl.dot(a, x) * s[:, None]
        elif IEEE:
            acc = tl.dot(a, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, x, acc)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if not BLOCK_SCALED:  # per-channel scale: the sums are linear in it, so partial sums may take it
        acc = acc * tl.load(S + rn_in)[:, None]
    _split_k_epilogue(acc, Out, Part, Locks, Bias, rn, rm, N, M, stride_om, split_k, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_w8a8_kernel(
    XQ, XS, W, S, Bias, Out, Part, Locks,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """W8A8: grid (N tiles, splits, M tiles); per-channel weight scales S [N], per-token XS [M]."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rn_in = tl.minimum(rn, N - 1)
    m_ok = rm < M
    w_ptr = W + rn_in[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptr = XQ + rm[None, :].to(tl.int64) * stride_xm + (k_lo + rk)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr)
            x = tl.load(x_ptr, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptr, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        # Each step's FP8 sum is added to the float32 accumulator (a promotion every BLOCK_K).
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=BLOCK_K)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    xs = tl.load(XS + rm, mask=m_ok, other=0.0)
    acc = acc * xs[None, :] * tl.load(S + rn_in)[:, None]
    _split_k_epilogue(acc, Out, Part, Locks, Bias, rn, rm, N, M, stride_om, split_k, HAS_BIAS)


def make_locks(n: int, device: torch.device | str) -> torch.Tensor:
    """A layer's lock counters (zeros; the kernels leave them zero): one per output tile of the
    smallest BLOCK_N, for up to MAX_SPLIT_M_TILES tiles of rows (more rows never split K)."""
    return torch.zeros(triton.cdiv(n, _MIN_BLOCK_N) * MAX_SPLIT_M_TILES, dtype=torch.int32, device=device)


def split_plan(m: int, n: int, k: int, cfg: GemmConfig, block_scaled: bool) -> tuple[int, int]:
    """(splits, K per split) for a config: whole BLOCK_K steps (whole scale blocks if block-scaled) per
    split, no empty split, and no split at all past MAX_SPLIT_M_TILES tiles of rows."""
    unit = SCALE_BLOCK if block_scaled else cfg.block_k
    steps = triton.cdiv(k, unit)
    split = min(cfg.split_k, steps) if triton.cdiv(m, cfg.block_m) <= MAX_SPLIT_M_TILES else 1
    per = triton.cdiv(steps, split) * unit
    return triton.cdiv(k, per), per


def _even_k(k: int, per: int, cfg: GemmConfig) -> bool:
    """Every step of every split a whole BLOCK_K: the loop needs no K mask."""
    return k % cfg.block_k == 0 and per % cfg.block_k == 0


def _workspace(m: int, n: int, split: int, cfg: GemmConfig, scale: torch.Tensor, locks: torch.Tensor | None):
    """(partials, locks) for a split-K launch. Without a split the kernel touches neither: it gets the
    scales (float32) and the locks or the scales' bits (int32) instead, the pointer types of a split
    launch, so that both take the same compiled kernel (and nothing is allocated)."""
    if split == 1:
        return scale, locks if locks is not None else scale.view(torch.int32)
    # NOTE: allocated per call (from the graph's pool under capture); the locks persist in the layer.
    part = torch.empty(split, m, n, dtype=torch.float32, device=scale.device)
    if locks is None:
        locks = make_locks(n, scale.device)
    assert cfg.block_n >= _MIN_BLOCK_N and locks.numel() >= triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m), \
        "lock buffer too small"
    return part, locks


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32, rows contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32, or [ceil(N / 128), ceil(K / 128)] float32 with block
    bias: torch.Tensor | None = None,  # [N], x's dtype
    block: tuple[int, int] | None = None,  # (128, 128) for block-scaled weights
    locks: torch.Tensor | None = None,  # make_locks(N), kept by the layer; allocated here if None
    config: GemmConfig | None = None,  # None: the tuned table's, else the default
) -> torch.Tensor:  # [M, N], x's dtype
    """Weight-only FP8 GEMM (see the module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == torch.float8_e4m3fn and x.stride(1) == 1 and weight.stride(1) == 1
    assert block is None or tuple(block) == (SCALE_BLOCK, SCALE_BLOCK)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    blocked = block is not None
    cfg = config or fp8_gemm_configs.tuned_or_default(m, n, k, False, blocked, x.device)
    assert not blocked or SCALE_BLOCK % cfg.block_k == 0, "a step must not cross a scale block"
    split, per = split_plan(m, n, k, cfg, blocked)
    part, locks = _workspace(m, n, split, cfg, scale, locks)
    _fp8_gemm_kernel[(triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))](
        x, weight, scale, bias if bias is not None else out, out, part, locks,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), scale.stride(0) if blocked else 0, per, split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=_even_k(k, per, cfg),
        BLOCK_SCALED=blocked, SB=SCALE_BLOCK, HAS_BIAS=bias is not None,
        FAST_DEQUANT=x.is_cuda and x.dtype in (torch.bfloat16, torch.float16), IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_gemm_w8a8(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, rows contiguous (fp8_quant.quantize_per_token)
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N], out_dtype
    out_dtype: torch.dtype,
    locks: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """W8A8 FP8 GEMM with per-token and per-channel scales (see the module docstring)."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.dtype == weight.dtype == torch.float8_e4m3fn and weight.shape[1] == k
    assert xq.stride(1) == 1 and weight.stride(1) == 1 and x_scale.numel() == m and scale.numel() == n
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = config or fp8_gemm_configs.tuned_or_default(m, n, k, True, False, xq.device)
    split, per = split_plan(m, n, k, cfg, False)
    part, locks = _workspace(m, n, split, cfg, scale, locks)
    _fp8_w8a8_kernel[(triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))](
        xq, x_scale, weight, scale, bias if bias is not None else out, out, part, locks,
        m, n, k, xq.stride(0), weight.stride(0), out.stride(0), per, split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=_even_k(k, per, cfg),
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
