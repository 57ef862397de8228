"""Sampling from logits in two Triton kernels: greedy, temperature, top-k and top-p, seeded per row.

Must equal `cluster.kernels.reference.sample` (same hash, same kept set, same Gumbel-max draw); the
two agree token for token except where float rounding decides a near tie.

1. `_first_pass_kernel`, one program per (row, chunk of CHUNK tokens), reading the logits once (any
   float dtype, converted in registers): greedy rows, the chunk's argmax; sampled rows, the chunk's
   argmax of logits / T + Gumbel noise (hashed from (seed, position, token id) on the fly: no [B, V]
   noise tensor), plus the chunk's max and softmax denominator. Chunks keep small batches parallel.
2. `_finish_kernel`, one program per row, combines the chunks (the first of equal maxima wins, as in
   an argmax) and, for rows with top-k/top-p, finds the winner within the kept set without a sort:
   the kept set is a prefix of the tokens ranked by (logit descending, id ascending), and the answer
   is the Gumbel winner within it. While the current candidate w is outside the kept set (top_k or
   more tokens, or top_p of the mass, rank before it), nothing ranked at or after w is kept either,
   so the search narrows to the tokens ranked before w: one pass counts them and sums their mass
   (the test for w) and finds their own Gumbel winner (the next candidate). The first candidate is
   kept with probability >= top_p, so top-p alone takes one more pass, rarely two. With top-k the
   same passes also bracket the k-th largest value between pivots, so that on flat rows (where the
   first winner is rarely in the top k) candidates soon come only from the few tokens above it.

Everything is per row, with a fixed tiling: a row samples the same token in any batch. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.reference import GOLDEN32, MIX_MUL1, MIX_MUL2, POSITION_MUL

BLOCK = 2048  # tokens a program reads per iteration
CHUNK = 8192  # tokens of a row per first-pass program (16 chunks for a 128k vocabulary)
FINISH_BLOCK = 1024  # the finish kernel's tiles: [tokens, 16 pivots] compares must stay in registers
_GOLDEN = tl.constexpr(GOLDEN32)
_POS_MUL = tl.constexpr(POSITION_MUL)
_MUL1 = tl.constexpr(MIX_MUL1)
_MUL2 = tl.constexpr(MIX_MUL2)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 16)


@triton.jit
def _gumbel(key, offs):
    h = _mix32(key + offs.to(tl.uint32) * _GOLDEN)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _check_pass(base, V, temp, m, w, xw, lo, hi, key, lanes, BLOCK: tl.constexpr, NT: tl.constexpr,
                PIVOTS: tl.constexpr, CANDIDATE: tl.constexpr):
    """One pass over a row: how many tokens rank before w and their mass; with PIVOTS, how many lie
    above each of NT pivots spread over [lo, hi); with CANDIDATE, the Gumbel winner among the tokens
    ranked before w and above lo (the next candidate)."""
    count = 0
    mass = 0.0
    above = tl.zeros([NT], tl.int32)
    pivots = lo + (hi - lo) * (tl.arange(0, NT).to(tl.float32) / NT)
    best = float("-inf")
    nxt = w
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
        before = (x > xw) | ((x == xw) & (offs < w))
        count += tl.sum(before.to(tl.int32), 0)
        mass += tl.sum(tl.where(before, tl.exp(x - m), 0.0), 0)
        if PIVOTS:
            above += tl.sum((x[:, None] > pivots[None, :]).to(tl.int32), 0)
        if CANDIDATE:
            s = tl.where(before & (x > lo), x + _gumbel(key, offs), float("-inf"))
            bm, bi = tl.max(s, 0, return_indices=True, return_indices_tie_break_left=True)
            take = bm > best
            nxt = tl.where(take, start + bi, nxt)
            best = tl.where(take, bm, best)
    return count, mass, above, pivots, nxt


@triton.jit
def _row_key(Seeds, Pos, row):
    seed = tl.load(Seeds + row).to(tl.int64)
    pos = tl.load(Pos + row).to(tl.int64)
    key = _mix32((seed >> 32).to(tl.uint32) ^ _GOLDEN)
    key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(key + (pos & 0xFFFFFFFF).to(tl.uint32) * _POS_MUL)


@triton.jit
def _first_pass_kernel(
    Logits, stride_row, Temp, Seeds, Pos, PartF, PartI, V,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    base = Logits + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    temp = tl.load(Temp + row)
    lo = chunk * CHUNK
    best = float("-inf")
    w = lo
    m = float("-inf")
    z = 0.0
    if temp == 0.0:
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            bm, bi = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
            take = bm > best
            w = tl.where(take, start + bi, w)
            best = tl.where(take, bm, best)
    else:
        key = _row_key(Seeds, Pos, row)
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
            s = x + _gumbel(key, offs)
            bm, bi = tl.max(s, 0, return_indices=True, return_indices_tie_break_left=True)
            take = bm > best
            w = tl.where(take, start + bi, w)
            best = tl.where(take, bm, best)
            m_new = tl.maximum(m, tl.max(x, 0))
            # (A chunk past the vocabulary's end keeps m = -inf and z = 0: guard exp(-inf - -inf).)
            z = z * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
    out = (row * num_chunks + chunk) * 3
    tl.store(PartF + out, best)
    tl.store(PartF + out + 1, m)
    tl.store(PartF + out + 2, z)
    tl.store(PartI + row * num_chunks + chunk, w)


@triton.jit
def _finish_kernel(
    Logits, stride_row, Temp, TopK, TopP, Seeds, Pos, PartF, PartI, Out, V, num_chunks,
    CP: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr, CUT: tl.constexpr, FEW: tl.constexpr,
    MAX_SEARCH: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, CP)
    ok = c < num_chunks
    part = (row * num_chunks + c) * 3
    best = tl.load(PartF + part, mask=ok, other=float("-inf"))
    m_c = tl.load(PartF + part + 1, mask=ok, other=float("-inf"))
    z_c = tl.load(PartF + part + 2, mask=ok, other=0.0)
    _, first = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    w = tl.load(PartI + row * num_chunks + first)
    m = tl.max(m_c, 0)  # -inf for greedy rows (their first pass skips it): keep exp() finite
    z = tl.sum(tl.where(m_c == float("-inf"), 0.0, z_c * tl.exp(m_c - tl.where(m == float("-inf"), 0.0, m))), 0)
    temp = tl.load(Temp + row)
    top_k = tl.load(TopK + row).to(tl.int32)
    top_p = tl.load(TopP + row)
    limit = tl.where(top_k > 0, top_k, V + 1)
    mass_limit = top_p * z
    use_k = limit < V
    if (temp != 0.0) & (use_k | (top_p < 1.0)):
        base = Logits + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        key = _row_key(Seeds, Pos, row)
        # Check the winner; with top-k, also bracket the k-th largest value between lo and hi
        # (count(x > lo) >= k > count(x > hi)) by NT pivots a pass, until at most FEW tokens lie
        # between: tokens at or below lo rank k-th or later, so candidates come from above lo.
        # lo starts at m - CUT: tokens that low never win (Gumbel noise of a 24-bit uniform lies in
        # [-2.85, 17.33], so the top token's score beats theirs) whether kept or not.
        xw = tl.load(base + w).to(tl.float32) / temp  # the same op as in the tiles: bit-identical
        lo = m - CUT
        hi = m
        n_lo = V + 1  # count(x > lo), not measured yet
        n_hi = 0  # count(x > m)
        passes = 0
        kept = w < 0
        go = w >= 0
        while go:
            if use_k:
                count, mass, above, pivots, nxt = _check_pass(base, V, temp, m, w, xw, lo, hi, key, lanes,
                                                              BLOCK, NT, True, False)
            else:
                count, mass, above, pivots, nxt = _check_pass(base, V, temp, m, w, xw, lo, hi, key, lanes,
                                                              BLOCK, NT, False, False)
            kept = (count < limit) & ((top_p >= 1.0) | (mass < mass_limit))
            ge = above >= limit  # pivots[0] == lo
            some = tl.max(ge.to(tl.int32), 0) > 0
            new_lo = tl.max(tl.where(ge, pivots, lo), 0)
            new_n_lo = tl.where(some, tl.min(tl.where(ge, above, V + 1), 0), tl.max(above, 0))
            new_hi = tl.min(tl.where(ge, hi, pivots), 0)
            new_n_hi = tl.max(tl.where(ge, n_hi, above), 0)
            lo = tl.where(use_k, new_lo, lo)
            hi = tl.where(use_k & some, new_hi, hi)
            n_lo = tl.where(use_k, new_n_lo, n_lo)
            n_hi = tl.where(use_k & some, new_n_hi, n_hi)
            passes += 1
            go = (kept == 0) & use_k & (n_lo >= limit) & (n_lo - n_hi > FEW) & (passes < MAX_SEARCH)
        # Narrow to the tokens ranked before the candidate (and above lo) until it is kept.
        searching = kept == 0
        while searching:
            count, mass, above, pivots, nxt = _check_pass(base, V, temp, m, w, xw, lo, hi, key, lanes,
                                                          BLOCK, NT, False, True)
            # No candidate left (only with NaN or infinite logits; with finite ones the top token is
            # always kept): stop on w rather than loop forever inside the graph.
            kept = (count < limit) & ((top_p >= 1.0) | (mass < mass_limit)) | (nxt == w)
            w = tl.where(kept, w, nxt)
            xw = tl.load(base + w).to(tl.float32) / temp
            searching = kept == 0
    tl.store(Out + row, w.to(tl.int64))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same arguments and result as the reference (less its `filtered` hint: the kernel decides per row)."""
    b, vocab = logits.shape
    assert logits.stride(1) == 1
    assert temperature.dtype == top_p.dtype == torch.float32 and seeds.dtype == torch.int64
    out = torch.empty(b, dtype=torch.int64, device=logits.device) if out is None else out
    if b == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    part_f = torch.empty(b, chunks, 3, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(b, chunks, dtype=torch.int32, device=logits.device)
    _first_pass_kernel[(b, chunks)](logits, logits.stride(0), temperature, seeds, positions, part_f, part_i, vocab,
                                    CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
    _finish_kernel[(b,)](logits, logits.stride(0), temperature, top_k, top_p, seeds, positions, part_f, part_i, out,
                         vocab, chunks, CP=max(2, triton.next_power_of_2(chunks)), BLOCK=FINISH_BLOCK, NT=16, CUT=24.0,
                         FEW=64, MAX_SEARCH=4, num_warps=8)
    return out
