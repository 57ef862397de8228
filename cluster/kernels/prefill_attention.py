"""Packed variable-length causal attention over the paged KV cache: every prefill sequence of a batch
in one Triton launch (flash-attention style: online softmax, bf16 tensor-core dots, fp32 accumulation).

Must equal the prefill path of `cluster.attention.torch_ref.TorchAttentionBackend` (causal, GQA,
optional sliding window), which runs one SDPA call per sequence. With an FP8 (e4m3) cache the K/V tiles
are widened to q's dtype in registers, k_scale folded into the score scale and v_scale applied to the
output; the reference dequantizes the cache (new tokens included) in float32.

Each sequence's new tokens are queries; its keys are everything in its block table up to its context
length: earlier chunks of a long prompt, a cached prefix, and the new tokens themselves (already
written to the cache by the rotary/KV kernel before attention runs). So one kernel serves fresh
prompts, later chunks and prefix-cache hits alike.

Work is split into (query head, query tile of BLOCK_M tokens of one sequence) programs. The tile list
comes from `plan_tiles`, built once per forward on the host from lengths it already knows (numpy, no
per-sequence Python loop, no device sync) and shared by every layer; longest tiles first. A tile
walks the keys from its window's start (0 without a sliding window) to its last query, masking every
key tile: separate unmasked and masked loops would save a few ALU ops per score but push the
128 x 128 tile past the register file (checked with the sm_90 resource report: spills).

A captured prefill pass (cluster/engine/prefill_graph_runner.py) launches a fixed grid, `max_tiles` of its
token bucket: the tiles it does not need name a sequence without queries, and their programs return
before loading anything.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M = 128  # query tokens per program; plan_tiles splits sequences at this granularity
_LOG2E = 1.4426950408889634


def plan_tiles(query_lens, context_lens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_query_lens [S + 1] and the tile list [2, num_tiles] (sequence, first query index), int32, in
    one host-to-device copy (the host arrays: `tile_plan`)."""
    cu, seq, start = tile_plan(query_lens, context_lens)
    packed = np.concatenate([cu, seq, start]).astype(np.int32)
    dev = torch.from_numpy(packed).to(device)
    return dev[: len(cu)], dev[len(cu) :].view(2, len(seq))


def max_tiles(num_tokens: int, num_seqs: int) -> int:
    """The most tiles `tile_plan` makes for at most num_seqs sequences of num_tokens tokens in all:
    sum(ceil(q_i / BLOCK_M)) <= num_tokens // BLOCK_M + num_seqs. A CUDA graph's fixed grid."""
    return num_tokens // BLOCK_M + num_seqs


def tile_plan(query_lens, context_lens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cu_query_lens [S + 1], each tile's sequence, each tile's first query index), int64 numpy. Tiles
    are ordered by the keys they attend to, most first, so that the longest programs start first and
    short ones fill the tail of the launch."""
    q = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    tiles = -(-q // BLOCK_M)
    seq = np.repeat(np.arange(len(q)), tiles)
    first_tile = np.cumsum(tiles) - tiles
    start = (np.arange(len(seq)) - np.repeat(first_tile, tiles)) * BLOCK_M
    keys = (ctx - q)[seq] + np.minimum(start + BLOCK_M, q[seq])  # the causal span each tile reads
    order = np.argsort(-keys, kind="stable")
    return cu, seq[order], start[order]


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_pos, KC, VC, bt_row, kv_head, lo, hi,
    stride_kb, stride_kt, stride_kh, scale_log2, window,
    SLIDING: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        offs = start + n
        valid = offs < hi
        blk = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
        kv = blk[:, None] * stride_kb + (offs % PAGE)[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(KC + kv, mask=valid[:, None], other=0.0).to(q.dtype)  # e4m3 -> q's dtype: exact
        v = tl.load(VC + kv, mask=valid[:, None], other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        ok = (offs[None, :] <= q_pos[:, None]) & valid[None, :]
        if SLIDING:
            ok = ok & (offs[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps m = -inf; subtract 0 instead (p = 0, no NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_bt", "num_tiles", "scratch_row"])  # vary per batch: compile once
def _prefill_attention_kernel(
    Q, KC, VC, Out, BT, CuQ, Ctx, Tiles,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh, num_tiles, scratch_row,
    scale_log2, v_scale, window,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, IEEE: tl.constexpr,
):
    head = tl.program_id(0)  # heads of one tile run side by side: GQA groups share K/V tiles in L2
    tile = tl.program_id(1)
    kv_head = head // G
    seq = tl.load(Tiles + tile)
    q_first = tl.load(Tiles + num_tiles + tile)
    q_begin = tl.load(CuQ + seq)
    q_len = tl.load(CuQ + seq + 1) - q_begin
    if q_first >= q_len:  # a graph's unused tile (cluster/engine/prefill_graph_runner.py): nothing to compute or store
        return
    ctx = tl.load(Ctx + seq)
    cached = ctx - q_len

    m_idx = q_first + tl.arange(0, BLOCK_M)
    q_ok = m_idx < q_len
    q_pos = cached + m_idx  # absolute positions of the tile's queries
    d = tl.arange(0, D)
    rows = (q_begin + m_idx).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_ok[:, None], other=0.0)

    q_lo = cached + q_first
    k_hi = tl.minimum(q_lo + BLOCK_M, ctx)  # past the tile's last query
    if SLIDING:
        k_lo = tl.maximum(q_lo - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        k_lo = 0
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, KC, VC, bt_row, kv_head, k_lo, k_hi,
                            stride_kb, stride_kt, stride_kh, scale_log2, window, SLIDING, D, PAGE, BLOCK_N, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    # Rows past the sequence's end go to scratch rows after the last token instead of being masked: a
    # masked store from the dot's register layout costs registers the tile cannot spare (spills).
    dst = tl.where(q_ok, q_begin + m_idx, scratch_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(Out + dst[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(Out.dtype.element_ty))


def prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], any row stride (a view of the fused QKV is fine)
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]: new tokens already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32: cached + new tokens per sequence
    cu_query_lens: torch.Tensor,  # [S + 1] int32, from plan_tiles
    tiles: torch.Tensor,  # [2, num_tiles] int32, from plan_tiles
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [T + BLOCK_M, num_heads, head_dim] (scratch rows last); allocated if None
    k_scale: float = 1.0,  # an e4m3 cache's scales (ignored for a cache in another dtype)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, num_heads, head_dim]: a view of out
    t, num_heads, head_dim = q.shape
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    _, page, kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert head_dim & (head_dim - 1) == 0 and num_heads % kv_heads == 0
    if out is None:
        out = torch.empty(t + BLOCK_M, num_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.shape == (t + BLOCK_M, num_heads, head_dim) and out.is_contiguous()
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return out[:t]
    # Tiles and warps that keep the loop in registers on sm_90 (ptxas resource report): 255 registers
    # and 32 bytes of stack at head_dim 128, none spilled at 64. float32 (tests) takes the exact FMA
    # path, which needs narrow key tiles to stay out of local memory.
    ieee = q.dtype == torch.float32
    block_n = 16 if ieee else 64 if head_dim >= 128 else 128
    _prefill_attention_kernel[(num_heads, num_tiles)](
        q, k_cache, v_cache, out, block_tables, cu_query_lens, context_lens, tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_tiles, t,
        scale * k_scale * _LOG2E, float(v_scale), sliding_window or 0,
        G=num_heads // kv_heads, D=head_dim, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        SLIDING=bool(sliding_window), IEEE=ieee, num_warps=8, num_stages=3,
    )
    return out[:t]
