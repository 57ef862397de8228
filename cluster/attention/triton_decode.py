"""Paged decode attention in Triton: attention backend "triton" (registry.py).

One program handles one (sequence, kv head, split): the G query heads sharing that kv head are one
[G, head_dim] tile (GQA costs one K/V read for G heads), and it walks its part of the sequence in
tiles of BLOCK_N tokens gathered through the block table, with an online softmax.

Flash-decoding: at small batch there are too few (sequence, kv head) pairs to fill the GPU, so each
sequence's context is split into `num_splits` parts run in parallel, each writing an unnormalised
partial output and its log-sum-exp; a second kernel merges them. The split count depends only on the
batch shape (host-static, so a captured graph keeps it); the part length is computed in the kernel
from the row's context length, so it adapts to the context without recapture.

Sliding window: only the last `window` positions are read.

FP8 KV cache: K/V tiles are widened from e4m3 to q's dtype in registers (exact; in bf16/f16 by
fp8_gemm.widen_e4m3's integer trick, not the conversion unit, which capped the FP8-KV step below the
bf16-KV one at large batch on an H200); k_scale is folded into
the score scale and v_scale applied to the normalised output (both linear), so the cache is read at one
byte an element and dequantized for free (`reference.kv_dequantize` in the torch reference). Prefill runs the packed paged kernel of
cluster/kernels/prefill_attention.py (one launch per layer for the whole batch); on CPU, where Triton
only has its interpreter, the torch reference's prefill.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from cluster import kernels
from cluster.attention.metadata import AttentionMetadata
from cluster.attention.torch_ref import TorchAttentionBackend
from cluster.kernels.fp8_gemm import widen_e4m3
from cluster.kernels.prefill_attention import plan_tiles, prefill_attention

BLOCK_N = 64
MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(
    Q, KC, VC, BT, CTX, MidO, MidLse, Out,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_mb, stride_mh, stride_ms,
    stride_ot, stride_oh,
    scale, v_scale, window,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
    FAST_WIDEN: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b).to(tl.int32)
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx - window, 0)
    per = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK) * BLOCK
    s_lo = lo + split * per
    s_hi = tl.minimum(s_lo + per, ctx)

    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    g_ok = g < G
    heads = kvh * G + g
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)

    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, BLOCK)
    for start in range(s_lo, s_hi, BLOCK):
        offs = start + n
        valid = offs < s_hi
        blk = tl.load(BT + b * stride_bt + offs // PAGE, mask=valid, other=0).to(tl.int64)
        kv_off = blk[:, None] * stride_kb + (offs % PAGE)[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(KC + kv_off, mask=valid[:, None], other=0.0)
        v = tl.load(VC + kv_off, mask=valid[:, None], other=0.0)
        if KV_FP8:  # e4m3 widens exactly to q's dtype (constexpr: the bf16 kernel is unchanged, no spills)
            k = widen_e4m3(k, Q.dtype.element_ty, FAST_WIDEN)
            v = widen_e4m3(v, Q.dtype.element_ty, FAST_WIDEN)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    if NUM_SPLITS == 1:  # the whole context in one program: write the normalised output directly
        out = acc / l[:, None]
        if KV_FP8:
            out = out * v_scale
        tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=g_ok[:, None])
    else:  # an empty split stores lse = -inf and weighs nothing in the merge
        lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        if KV_FP8:
            out = out * v_scale
        base = b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(MidO + base[:, None] * D + d[None, :], out, mask=g_ok[:, None])
        tl.store(MidLse + base, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    MidO, MidLse, Out,
    stride_mb, stride_mh, stride_ms, stride_ot, stride_oh,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    base = b * stride_mb + h * stride_mh + s * stride_ms
    lse = tl.load(MidLse + base, mask=s < NUM_SPLITS, other=float("-inf"))
    o = tl.load(MidO + base[:, None] * D + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty (context >= 1), so max is finite
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence so that batch * kv_heads * splits covers about two waves of SMs."""
    work = batch * num_kv_heads
    return max(1, min(MAX_SPLITS, -(-2 * _num_sms(device) // work)))


# NOTE: kept out of torch.compile (serving doesn't compile; benchmarks/bench_decode.py times a compiled
# step for comparison): its split count is computed from the batch size on the host, which under a
# dynamic-shape compile would guard on (and recompile for) every bucket.
@torch.compiler.disable
def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,  # an e4m3 cache's scales (ignored for a cache in another dtype)
    v_scale: float = 1.0,
) -> torch.Tensor:
    bsz, num_heads, head_dim = q.shape
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    _, page, kv_heads, _ = k_cache.shape
    assert k_cache.stride(3) == 1 and q.stride(2) == 1 and head_dim & (head_dim - 1) == 0
    group = num_heads // kv_heads
    splits = num_splits or choose_num_splits(bsz, kv_heads, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a strided view
    if splits > 1:
        mid_o = torch.empty(bsz, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(bsz, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    ms = (num_heads * splits, splits, 1)  # strides of mid_lse, and of mid_o in units of head_dim
    _decode_split_kernel[(bsz, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *ms,
        out.stride(0), out.stride(1),
        scale * k_scale, float(v_scale), sliding_window or 0,
        G=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim, PAGE=page, BLOCK=BLOCK_N,
        NUM_SPLITS=splits, SLIDING=bool(sliding_window), IEEE=q.dtype == torch.float32,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, FAST_WIDEN=q.is_cuda and q.dtype != torch.float32,
        # 8 warps at head_dim 128: with 4 the [BLOCK, 128] K/V tiles spill (sm_90 resource report).
        num_warps=8 if head_dim >= 128 else 4, num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(bsz, num_heads)](
            mid_o, mid_lse, out, *ms, out.stride(0), out.stride(1),
            D=head_dim, NUM_SPLITS=splits, SP=triton.next_power_of_2(splits), num_warps=1,
        )
    return out


class TritonAttentionBackend(TorchAttentionBackend):
    """Decode through the split-K kernel, prefill through the packed paged kernel (torch's on CPU)."""

    name = "triton"

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        if not meta.is_prefill or meta.prefill_plan is not None or not kernels.enabled(meta.block_tables):
            return meta  # a captured prefill pass brings its own plan, in static buffers
        return dataclasses.replace(meta, prefill_plan=plan_tiles(meta.query_lens, meta.context_lens_host,
                                                                   meta.block_tables.device))

    def forward(self, q, k, v, kv_layer, meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0):
        if not meta.is_prefill:
            return paged_decode_attention(q, kv_layer[0], kv_layer[1], meta.block_tables, meta.context_lens,
                                          self.scale, self.sliding_window, k_scale=k_scale, v_scale=v_scale)
        if meta.prefill_plan is None:
            return self._prefill(q, k, v, kv_layer, meta, k_scale, v_scale)
        cu_query_lens, tiles = meta.prefill_plan
        return prefill_attention(q, kv_layer[0], kv_layer[1], meta.block_tables, meta.context_lens, cu_query_lens,
                                 tiles, self.scale, self.sliding_window, k_scale=k_scale, v_scale=v_scale)
