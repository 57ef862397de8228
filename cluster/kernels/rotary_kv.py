"""Rotary embedding of q and k plus the paged KV write, in one Triton kernel reading the fused QKV.

Must equal `cluster.kernels.reference.rotary_store_kv`. One program per token reads its q, k and v
straight out of the QKV projection's output row (by stride: no split, no contiguous copy), takes
cos/sin from the table row of its position (built once per model in the activation dtype, so no
per-layer gather or cast), rotates q and k in place in that row, and writes k and v into the token's
slot of the paged cache. Products and sums are rounded to the activation dtype where torch rounds
them, so in bfloat16 it is bit-exact with the reference on the GPU. That needs FP fusion off: with it
(Triton's default) x1 * c - x2 * s compiles to one bf16 fma (one rounding where torch rounds twice),
which moved k by a bf16 step on ~0.1% of elements on an H200 and, where the two products nearly
cancel, turned the reference's 0 into a nonzero e4m3 value in an FP8 cache. An FP8 (e4m3) cache stores
e4m3(clamp(k / k_scale, +-448)) and likewise v, `reference.kv_quantize`'s rounding (an IEEE division
on both sides, then round to nearest even: torch's cast and the GPU's cvt.rn.satfinite agree).

Attention then reads q from the QKV row (strided) and K/V from the cache, or the new tokens' k and v
from the row as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kv_kernel(
    QKV, Pos, CosSin, KC, VC, Slots,
    stride_t, stride_cs, stride_slot, k_scale, v_scale,
    H: tl.constexpr, KH: tl.constexpr, QKP: tl.constexpr, KP: tl.constexpr, D: tl.constexpr, KV_FP8: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    DT: tl.constexpr = QKV.dtype.element_ty  # round to it where torch rounds (a no-op in float32)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    c = tl.load(CosSin + pos * stride_cs + d).to(tl.float32)
    s = tl.load(CosSin + pos * stride_cs + HALF + d).to(tl.float32)
    row = QKV + t * stride_t

    # q heads then k heads are adjacent in the row: rotate them as one [H + KH, D] tile.
    h = tl.arange(0, QKP)[:, None]
    ok = h < H + KH
    ptr = row + h * D + d
    x1 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them.
    o1 = ((x1 * c).to(DT).to(tl.float32) - (x2 * s).to(DT).to(tl.float32)).to(DT)
    o2 = ((x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)).to(DT)
    tl.store(ptr, o1, mask=ok)
    tl.store(ptr + HALF, o2, mask=ok)
    is_k = ok & (h >= H)
    kc = KC + slot * stride_slot + (h - H) * D + d
    tl.store(kc, _to_cache(o1, k_scale, KC, KV_FP8), mask=is_k)
    tl.store(kc + HALF, _to_cache(o2, k_scale, KC, KV_FP8), mask=is_k)

    hv = tl.arange(0, KP)[:, None]
    dv = tl.arange(0, D)[None, :]
    v = tl.load(row + (H + KH) * D + hv * D + dv, mask=hv < KH, other=0.0)
    tl.store(VC + slot * stride_slot + hv * D + dv, _to_cache(v, v_scale, VC, KV_FP8), mask=hv < KH)


@triton.jit
def _to_cache(x, scale, Cache, KV_FP8: tl.constexpr):
    """x in the cache's dtype; an FP8 cache gets e4m3(clamp(x / scale)) (IEEE division, as torch's)."""
    if KV_FP8:
        y = tl.math.div_rn(x.to(tl.float32), tl.zeros(x.shape, tl.float32) + scale)
        return tl.minimum(tl.maximum(y, -448.0), 448.0).to(Cache.dtype.element_ty)
    return x.to(Cache.dtype.element_ty)


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and results as the reference; q and k are rotated in place inside `qkv` and the
    returned q, k, v are strided views of it."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.shape[1] == q_size + 2 * kv_size and qkv.stride(1) == 1
    assert cos_sin.dtype == qkv.dtype and cos_sin.stride(1) == 1 and cos_sin.shape[1] == head_dim
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    # Slots are flat indices over [num_blocks, block_size]: those two dims must be one stride apart.
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1) and k_cache.stride(1) == v_cache.stride(1)
    assert k_cache.stride(1) == num_kv_heads * head_dim and k_cache.stride(3) == 1
    if t:
        _rotary_kv_kernel[(t,)](
            qkv, positions, cos_sin, k_cache, v_cache, slot_mapping,
            qkv.stride(0), cos_sin.stride(0), k_cache.stride(1), float(k_scale), float(v_scale),
            H=num_heads, KH=num_kv_heads, QKP=triton.next_power_of_2(num_heads + num_kv_heads),
            KP=triton.next_power_of_2(num_kv_heads), D=head_dim, KV_FP8=kv_layer.dtype == torch.float8_e4m3fn,
            num_warps=4, enable_fp_fusion=False,  # NOTE: see the module docstring
        )
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim)
    return q, k, v
