"""Rotary embedding of q and k plus the paged KV write, in one Triton kernel reading the fused QKV.

Must equal `cluster.kernels.reference.rotary_store_kv`. One program per token reads its q, k and v
straight out of the QKV projection's output row (by stride: no split, no contiguous copy), takes
cos/sin from the table row of its position (built once per model in the activation dtype, so no
per-layer gather or cast), rotates q and k in place in that row, and writes k and v into the token's
slot of the paged cache. Products and sums are rounded to the activation dtype where torch rounds
them, so in bfloat16 it is bit-exact with the reference.

Attention then reads q from the QKV row (strided) and K/V from the cache, or the new tokens' k and v
from the row as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rnd(x, DTYPE: tl.constexpr):
    """Round a float32 value to the activation dtype and back (identity for float32)."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate(x1, x2, c, s, DTYPE: tl.constexpr):
    o1 = _rnd(_rnd(x1 * c, DTYPE) - _rnd(x2 * s, DTYPE), DTYPE)
    o2 = _rnd(_rnd(x2 * c, DTYPE) + _rnd(x1 * s, DTYPE), DTYPE)
    return o1, o2


@triton.jit
def _rotary_kv_kernel(
    QKV, Pos, CosSin, KC, VC, Slots,
    stride_t, stride_cs, stride_slot,
    H: tl.constexpr, KH: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr, D: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    DTYPE: tl.constexpr = QKV.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    d = tl.arange(0, HALF)
    c = tl.load(CosSin + pos * stride_cs + d).to(tl.float32)[None, :]
    s = tl.load(CosSin + pos * stride_cs + HALF + d).to(tl.float32)[None, :]
    row = QKV + t * stride_t

    hq = tl.arange(0, HP)[:, None]
    mq = hq < H
    q_ptr = row + hq * D + d[None, :]
    q1 = tl.load(q_ptr, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=mq, other=0.0).to(tl.float32)
    q1, q2 = _rotate(q1, q2, c, s, DTYPE)
    tl.store(q_ptr, q1.to(DTYPE), mask=mq)
    tl.store(q_ptr + HALF, q2.to(DTYPE), mask=mq)

    hk = tl.arange(0, KP)[:, None]
    mk = hk < KH
    k_ptr = row + H * D + hk * D + d[None, :]
    k1 = tl.load(k_ptr, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + HALF, mask=mk, other=0.0).to(tl.float32)
    k1, k2 = _rotate(k1, k2, c, s, DTYPE)
    tl.store(k_ptr, k1.to(DTYPE), mask=mk)
    tl.store(k_ptr + HALF, k2.to(DTYPE), mask=mk)
    kc_ptr = KC + slot * stride_slot + hk * D + d[None, :]
    tl.store(kc_ptr, k1.to(KC.dtype.element_ty), mask=mk)
    tl.store(kc_ptr + HALF, k2.to(KC.dtype.element_ty), mask=mk)

    dv = tl.arange(0, D)[None, :]
    v = tl.load(row + (H + KH) * D + hk * D + dv, mask=mk, other=0.0)
    tl.store(VC + slot * stride_slot + hk * D + dv, v.to(VC.dtype.element_ty), mask=mk)


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
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
            qkv.stride(0), cos_sin.stride(0), k_cache.stride(1),
            H=num_heads, KH=num_kv_heads, HP=triton.next_power_of_2(num_heads),
            KP=triton.next_power_of_2(num_kv_heads), D=head_dim, num_warps=4,
        )
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim)
    return q, k, v
