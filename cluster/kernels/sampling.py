"""Sampling from logits in two Triton kernels: greedy, temperature, top-k, top-p and min-p, seeded per row.

Must equal `cluster.kernels.reference.sample` (same hash, same kept set, same Gumbel-max draw); the
two agree token for token except where float rounding decides a near tie.

1. `_first_pass_kernel`, one program per (row, chunk of CHUNK tokens), reading the logits once (any
   float dtype, converted in registers): greedy rows, the chunk's argmax; sampled rows, the chunk's
   argmax of logits / T + Gumbel noise (hashed from (seed, position, token id) on the fly: no [B, V]
   noise tensor), plus the chunk's max and softmax denominator. Rows that filter (top-k, top-p or
   min-p) also count their chunk's tokens in NBINS bins of width 1/8 below the chunk's max, on a grid
   shared by every chunk (bin edges are multiples of 1/8), in a second loop over the chunk (in cache).
2. `_finish_kernel`, one program per row, combines the chunks (the first of equal maxima wins, as in
   an argmax). A filtering row adds up its chunks' histograms on the common grid; from the counts
   alone (mass bounded per bin by count * exp(bin edge - max)) it finds the bins whose tokens are
   surely kept (few enough tokens and little enough mass before the bin's end, above the min-p
   line) and the first bin whose tokens are surely not. The kept set is a prefix of the tokens ranked
   by (logit descending, id ascending), so the answer is the Gumbel winner within it:
   - the first pass's winner, if it lies in a surely kept bin (it wins over every token, kept or not);
   - else one pass over the row draws the Gumbel winner among the candidates (tokens above the first
     surely cut bin), skipping tiles with no candidate; if it lies in a surely kept bin, done;
   - else (it lies in one of the few uncertain bins) exact checks: count the tokens ranked before it
     and their mass; while it is not kept, the next candidate is the Gumbel winner among the tokens
     ranked before it (tiles below the candidate skipped). A row of NaN or infinite logits stops on its
     first candidate rather than loop inside the graph.
   So a filtered row costs one extra pass over its chunk (cached) in the first kernel and at most one
   pass (usually over a few tiles) in the finish, plus exact checks only in the rare uncertain case.

Everything is per row, with a fixed tiling: a row samples the same token in any batch. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.reference import GOLDEN32, MIX_MUL1, MIX_MUL2, POSITION_MUL

BLOCK = 2048  # tokens a program reads per iteration
CHUNK = 8192  # tokens of a row per first-pass program (16 chunks for a 128k vocabulary)
FINISH_BLOCK = 2048  # the finish kernel's tiles
NBINS = 255  # histogram bins of width 1/8 below a chunk's max (bin NBINS: everything lower)
BINS_PER_UNIT = 8.0
GRID_LIMIT = 4194304.0  # |max| * 8 beyond this: bins lose integer precision; the row takes the exact path
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
def _row_key(Seeds, Pos, row):
    seed = tl.load(Seeds + row).to(tl.int64)
    pos = tl.load(Pos + row).to(tl.int64)
    key = _mix32((seed >> 32).to(tl.uint32) ^ _GOLDEN)
    key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(key + (pos & 0xFFFFFFFF).to(tl.uint32) * _POS_MUL)


@triton.jit
def _bin_of(x, top, NBINS: tl.constexpr):
    """Bin of scaled logits x below grid point `top` (= floor(max * 8)), as float in [0, NBINS]:
    bin j holds floor(x * 8) == top - j; NBINS holds everything lower (and -inf, NaN)."""
    b = top - tl.floor(x * 8.0)
    return tl.where(b < NBINS, b, NBINS)


@triton.jit
def _filters(TopK, TopP, LogMinP, row, V):
    top_k = tl.load(TopK + row).to(tl.int32)
    top_p = tl.load(TopP + row)
    log_min_p = tl.load(LogMinP + row)
    limit = tl.where(top_k > 0, top_k, V + 1)
    return limit, top_p, log_min_p, (limit < V) | (top_p < 1.0) | (log_min_p > float("-inf"))


@triton.jit
def _first_pass_kernel(
    Logits, stride_row, Temp, TopK, TopP, LogMinP, Seeds, Pos, PartF, PartI, Hist, V,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, NBP: tl.constexpr,
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
    top = float("nan")  # grid point of the chunk's max (filtering rows only)
    out = (row * num_chunks + chunk) * 4
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
            # (A chunk of -inf keeps m = -inf and z = 0: guard exp(-inf - -inf).)
            z = z * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        _, _, _, filtering = _filters(TopK, TopP, LogMinP, row, V)
        if filtering:
            grid_ok = tl.abs(m * 8.0) < 4194304.0  # False for +-inf and NaN too
            top = tl.where(grid_ok, tl.floor(m * 8.0), float("nan"))
            hist = tl.zeros([NBP], tl.int32)
            if grid_ok:
                for start in range(lo, lo + CHUNK, BLOCK):
                    offs = start + lanes
                    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
                    if _bin_of(tl.max(x, 0), top, NBINS) < NBINS:  # a tile entirely below the range adds nothing
                        b = _bin_of(x, top, NBINS)
                        hist += tl.histogram(b.to(tl.int32), NBP, mask=b < NBINS)
            tl.store(Hist + (row * num_chunks + chunk) * NBP + tl.arange(0, NBP), hist)
    tl.store(PartF + out, best)
    tl.store(PartF + out + 1, m)
    tl.store(PartF + out + 2, z)
    tl.store(PartF + out + 3, top)
    tl.store(PartI + row * num_chunks + chunk, w)


@triton.jit
def _draw_pass(base, V, temp, key, lanes, cut, top, w, xw, RANKED_BEFORE: tl.constexpr, COUNT: tl.constexpr,
               m, BLOCK: tl.constexpr, NBINS: tl.constexpr):
    """One pass over a row. Candidates: tokens whose bin is < cut (RANKED_BEFORE: ranked before w,
    i.e. (x, -id) > (xw, -w), instead). Returns the candidates' Gumbel winner (w if none) and, with
    COUNT, how many tokens rank before w and their mass exp(x - m). Tiles without a candidate are
    skipped (their tokens rank after w, so they count nothing either)."""
    count = 0
    mass = 0.0
    best = float("-inf")
    nxt = w
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
        tmax = tl.max(x, 0)
        if RANKED_BEFORE:
            live = tmax >= xw
        else:
            live = _bin_of(tmax, top, NBINS) < cut
        if live:
            if RANKED_BEFORE:
                cand = (x > xw) | ((x == xw) & (offs < w))
            else:
                cand = _bin_of(x, top, NBINS) < cut
            if COUNT:
                count += tl.sum(cand.to(tl.int32), 0)
                mass += tl.sum(tl.where(cand, tl.exp(x - m), 0.0), 0)
            s = tl.where(cand, x + _gumbel(key, offs), float("-inf"))
            bm, bi = tl.max(s, 0, return_indices=True, return_indices_tie_break_left=True)
            take = bm > best
            nxt = tl.where(take, start + bi, nxt)
            best = tl.where(take, bm, best)
    return nxt, count, mass


@triton.jit
def _finish_kernel(
    Logits, stride_row, Temp, TopK, TopP, LogMinP, Seeds, Pos, PartF, PartI, Hist, Out, V, num_chunks,
    CP: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, NBP: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, CP)
    ok = c < num_chunks
    part = (row * num_chunks + c) * 4
    best = tl.load(PartF + part, mask=ok, other=float("-inf"))
    m_c = tl.load(PartF + part + 1, mask=ok, other=float("-inf"))
    z_c = tl.load(PartF + part + 2, mask=ok, other=0.0)
    _, first = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    w = tl.load(PartI + row * num_chunks + first)
    m = tl.max(m_c, 0)  # -inf for greedy rows (their first pass skips it): keep exp() finite
    z = tl.sum(tl.where(m_c == float("-inf"), 0.0, z_c * tl.exp(m_c - tl.where(m == float("-inf"), 0.0, m))), 0)
    temp = tl.load(Temp + row)
    limit, top_p, log_min_p, filtering = _filters(TopK, TopP, LogMinP, row, V)
    if (temp != 0.0) & filtering:
        base = Logits + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        key = _row_key(Seeds, Pos, row)
        mass_limit = tl.where(top_p < 1.0, top_p * z, float("inf"))  # inf: no top-p
        thr = m + log_min_p
        # The row's histogram on the common grid: chunk c's bin j is the row's bin j + (top - top_c).
        top_c = tl.load(PartF + part + 3, mask=ok, other=float("-inf"))
        grid_ok = tl.sum((ok & (top_c != top_c)).to(tl.int32), 0) == 0  # no chunk without a grid (NaN)
        top = tl.max(tl.where(ok, top_c, float("-inf")), 0)
        j = tl.arange(0, NBP)
        hist = tl.zeros([NBP], tl.int32)
        for ci in range(0, num_chunks):
            t_ci = tl.load(PartF + (row * num_chunks + ci) * 4 + 3)
            src = j - (top - t_ci).to(tl.int32)
            hist += tl.load(Hist + (row * num_chunks + ci) * NBP + src, mask=(src >= 0) & (src < NBINS) & (j < NBINS),
                            other=0)
        below = V - tl.sum(hist, 0)  # the last bin: everything under the grid
        hist = tl.where(j == NBINS, below, hist)
        lo_edge = tl.where(j < NBINS, (top - j) * 0.125, float("-inf"))
        hi_edge = tl.minimum((top - j + 1) * 0.125, m)
        cnt = tl.cumsum(hist, 0)
        m_lo = tl.cumsum(hist.to(tl.float32) * tl.exp(lo_edge - m), 0)
        m_hi = tl.cumsum(hist.to(tl.float32) * tl.exp(hi_edge - m), 0)
        sure = (j <= NBINS) & (cnt <= limit) & (m_hi <= mass_limit) & (lo_edge >= thr)
        cut_bin = (j <= NBINS) & ((cnt - hist >= limit) | (m_lo - hist.to(tl.float32) * tl.exp(lo_edge - m) >= mass_limit) | (hi_edge <= thr))
        n_sure = tl.sum(sure.to(tl.int32), 0)  # both are prefixes of the bins: their lengths
        n_cand = NBINS + 1 - tl.sum(cut_bin.to(tl.int32), 0)
        if grid_ok == 0:  # no usable grid (huge or non-finite logits): every token a candidate, none sure
            n_sure = 0
            n_cand = NBINS + 1
        xw = tl.load(base + w).to(tl.float32) / temp  # the same op as in the tiles: bit-identical
        bw = _bin_of(xw, top, NBINS)
        if bw >= n_sure:
            if bw >= n_cand:
                # Surely cut: draw again among the candidates (a superset of the kept set). (A first-pass
                # winner among the candidates is already their winner: no pass for it.)
                w, _, _ = _draw_pass(base, V, temp, key, lanes, n_cand, top, w, xw, False, False, m, BLOCK, NBINS)
                xw = tl.load(base + w).to(tl.float32) / temp
            searching = _bin_of(xw, top, NBINS) >= n_sure
            while searching:
                # Exact: is w kept? If not, the next candidate is the winner among those ranked before it.
                nxt, count, mass = _draw_pass(base, V, temp, key, lanes, n_cand, top, w, xw, True, True, m,
                                              BLOCK, NBINS)
                kept = (count < limit) & (mass < mass_limit) & (xw >= thr)
                kept = kept | (nxt == w)  # no candidate left: only with NaN or infinite logits
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
    log_min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same arguments and result as the reference (less its `filtered` hint: the kernel decides per row)."""
    b, vocab = logits.shape
    assert logits.stride(1) == 1
    assert temperature.dtype == top_p.dtype == torch.float32 and seeds.dtype == torch.int64
    out = torch.empty(b, dtype=torch.int64, device=logits.device) if out is None else out
    if b == 0:
        return out
    if log_min_p is None:
        log_min_p = torch.full((b,), float("-inf"), dtype=torch.float32, device=logits.device)
    chunks = triton.cdiv(vocab, CHUNK)
    nbp = triton.next_power_of_2(NBINS + 1)
    part_f = torch.empty(b, chunks, 4, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(b, chunks, dtype=torch.int32, device=logits.device)
    hist = torch.empty(b, chunks, nbp, dtype=torch.int32, device=logits.device)
    _first_pass_kernel[(b, chunks)](logits, logits.stride(0), temperature, top_k, top_p, log_min_p, seeds, positions,
                                    part_f, part_i, hist, vocab, CHUNK=CHUNK, BLOCK=BLOCK, NBINS=NBINS, NBP=nbp,
                                    num_warps=8)
    _finish_kernel[(b,)](logits, logits.stride(0), temperature, top_k, top_p, log_min_p, seeds, positions, part_f,
                         part_i, hist, out, vocab, chunks, CP=max(2, triton.next_power_of_2(chunks)),
                         BLOCK=FINISH_BLOCK, NBINS=NBINS, NBP=nbp, num_warps=8)
    return out
