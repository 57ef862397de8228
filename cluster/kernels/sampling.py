"""Sampling from logits in Triton: greedy, temperature, top-k, top-p and min-p, seeded per row.

Must equal `cluster.kernels.reference.sample` (same hash, same kept set, same Gumbel-max draw); the
two agree token for token except where float rounding decides a near tie.

1. `_first_pass_kernel`, one program per (row, chunk of CHUNK tokens), reading the logits once (any
   float dtype, converted in registers): greedy rows, the chunk's argmax; sampled rows, the chunk's
   argmax of logits / T + Gumbel noise (hashed from (seed, position, token id) on the fly: no [B, V]
   noise tensor), plus the chunk's max and softmax denominator. Rows that filter (top-k, top-p or
   min-p) also count their chunk's tokens in NBINS bins of width 1/8 below the chunk's max, on a grid
   shared by every chunk (bin edges are multiples of 1/8), in a second loop over the chunk (in cache).
2. `_threshold_kernel`, one program per row, combines the chunks (the first of equal maxima wins, as
   in an argmax). A filtering row adds up its chunks' histograms on the common grid; from the counts
   alone (mass bounded per bin by count * exp(bin edge - max)) it finds the bins whose tokens are
   surely kept (few enough tokens and little enough mass before the bin's end, above the min-p line)
   and the first bin whose tokens are surely not. The kept set is a prefix of the tokens ranked by
   (logit descending, id ascending), so the answer is the Gumbel winner within it; if the first pass's
   winner lies in a surely kept bin it is that winner (it wins over every token, kept or not): done.
3. `_candidate_kernel`, one program per (row, chunk) again, only for the rows not done: one pass over
   the chunk finds the Gumbel winner among its surely kept tokens and their exact mass and count, and
   appends its uncertain tokens (in the bins between) to a short per-row list (CAP entries).
4. `_resolve_kernel`, one program per row: each uncertain token is kept iff the tokens ranked before
   it (the surely kept ones, then the uncertain ones before it, compared pairwise) are fewer than
   top_k, their mass is below top_p's, and it is above the min-p line; the answer is the Gumbel winner
   of the surely kept and the kept uncertain tokens. A row with more than CAP uncertain tokens (no
   usable grid: huge, infinite or NaN logits; or a very flat row's top-p boundary) takes the exact
   serial search instead: the winner among the candidates, then while it is not kept the winner
   among the tokens ranked before it (a pass over the row each; a row of NaN or infinite logits stops
   on its first candidate rather than loop inside the graph).
   So a filtered row costs one extra pass over its chunk (cached) in the first kernel and one parallel
   pass in the third, never a pass over the whole row in one program (the serial latency of 16
   chunks' worth of tiles, which at batch 1 was most of the cost).

Everything is per row, with a fixed tiling: a row samples the same token in any batch. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.reference import GOLDEN32, MAX_UNIFORM, MIX_MUL1, MIX_MUL2, POSITION_MUL

BLOCK = 2048  # tokens a program reads per iteration
CHUNK = 8192  # tokens of a row per first-pass program (16 chunks for a 128k vocabulary)
FINISH_BLOCK = 2048  # the finish kernel's tiles
NBINS = 255  # histogram bins of width 1/8 below a chunk's max (bin NBINS: everything lower)
CAP = 512  # uncertain tokens a row resolves exactly in the fourth kernel (more: the serial search)
UB = 32  # uncertain tokens compared at a time
BINS_PER_UNIT = 8.0
GRID_LIMIT = 4194304.0  # |max| * 8 beyond this: bins lose integer precision; the row takes the exact path
_GOLDEN = tl.constexpr(GOLDEN32)
_MAX_U = tl.constexpr(MAX_UNIFORM)
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
    u = tl.minimum(u, _MAX_U)  # the top value rounds to 1.0: a NaN score for a -inf logit (reference.MAX_UNIFORM)
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
def _row_grid(PartF, Hist, row, num_chunks, ok, part, m, z, top_p, limit, log_min_p, V,
              CP: tl.constexpr, NBINS: tl.constexpr, NBP: tl.constexpr):
    """The row's histogram on the common grid -> (top, n_sure, n_cand, mass_limit, thr): bins < n_sure
    hold only surely kept tokens, bins >= n_cand only surely cut ones."""
    mass_limit = tl.where(top_p < 1.0, top_p * z, float("inf"))  # inf: no top-p
    thr = m + log_min_p
    # Chunk c's bin j is the row's bin j + (top - top_c).
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
    n_sure = tl.where(grid_ok, n_sure, 0)  # no usable grid (huge or non-finite logits): every token a
    n_cand = tl.where(grid_ok, n_cand, NBINS + 1)  # candidate, none sure
    return top, n_sure, n_cand, mass_limit, thr


@triton.jit
def _threshold_kernel(
    Logits, stride_row, Temp, TopK, TopP, LogMinP, PartF, PartI, Hist, Out, RowF, RowI, UncN, V, num_chunks,
    CP: tl.constexpr, NBINS: tl.constexpr, NBP: tl.constexpr,
):
    """Per row: the first pass's winner, and for a filtering row whether it is surely kept (done) or
    the row goes on to the candidate pass (RowI[row, 0] = 1, with its grid in RowF / RowI)."""
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
    todo = 0
    if (temp != 0.0) & filtering:
        top, n_sure, n_cand, mass_limit, thr = _row_grid(PartF, Hist, row, num_chunks, ok, part, m, z, top_p, limit,
                                                         log_min_p, V, CP, NBINS, NBP)
        xw = tl.load(Logits + row.to(tl.int64) * stride_row + w).to(tl.float32) / temp  # as in the tiles: bit-identical
        if _bin_of(xw, top, NBINS) >= n_sure:
            todo = 1
            tl.store(RowF + row * 4, m)
            tl.store(RowF + row * 4 + 1, mass_limit)
            tl.store(RowF + row * 4 + 2, thr)
            tl.store(RowF + row * 4 + 3, top)
            tl.store(RowI + row * 4 + 1, n_sure)
            tl.store(RowI + row * 4 + 2, n_cand)
            tl.store(RowI + row * 4 + 3, w)
            tl.store(UncN + row, 0)
    tl.store(RowI + row * 4, todo)
    tl.store(Out + row, w.to(tl.int64))  # the answer unless the row goes on


@triton.jit
def _candidate_kernel(
    Logits, stride_row, Temp, Seeds, Pos, RowF, RowI, CandF, CandI, UncX, UncId, UncN, V,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, CAP: tl.constexpr,
):
    """Per (row, chunk) of a row not done: the Gumbel winner among the chunk's surely kept tokens, their
    mass exp(x - m) and count; the chunk's uncertain tokens appended to the row's list."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(RowI + row * 4) != 0:
        num_chunks = tl.num_programs(1)
        base = Logits + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        temp = tl.load(Temp + row)
        key = _row_key(Seeds, Pos, row)
        m = tl.load(RowF + row * 4)
        top = tl.load(RowF + row * 4 + 3)
        n_sure = tl.load(RowI + row * 4 + 1)
        n_cand = tl.load(RowI + row * 4 + 2)
        lo = chunk * CHUNK
        best = float("-inf")
        w = lo
        mass = 0.0
        count = 0
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
            b = _bin_of(x, top, NBINS)
            sure = (b < n_sure) & (offs < V)
            unc = (b >= n_sure) & (b < n_cand) & (offs < V)
            s = tl.where(sure, x + _gumbel(key, offs), float("-inf"))
            bm, bi = tl.max(s, 0, return_indices=True, return_indices_tie_break_left=True)
            take = bm > best
            w = tl.where(take, start + bi, w)
            best = tl.where(take, bm, best)
            mass += tl.sum(tl.where(sure, tl.exp(x - m), 0.0), 0)
            count += tl.sum(sure.to(tl.int32), 0)
            nu = tl.sum(unc.to(tl.int32), 0)
            if nu > 0:
                at = tl.atomic_add(UncN + row, nu)
                idx = at + tl.cumsum(unc.to(tl.int32), 0) - 1
                keep = unc & (idx < CAP)
                tl.store(UncX + row * CAP + idx, x, mask=keep)
                tl.store(UncId + row * CAP + idx, offs, mask=keep)
        out = (row * num_chunks + chunk) * 2
        tl.store(CandF + out, best)
        tl.store(CandF + out + 1, mass)
        tl.store(CandI + out, w)
        tl.store(CandI + out + 1, count)


@triton.jit
def _resolve_kernel(
    Logits, stride_row, Temp, TopK, TopP, LogMinP, Seeds, Pos, RowF, RowI, CandF, CandI, UncX, UncId, UncN,
    Out, V, num_chunks,
    CP: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, CAP: tl.constexpr, UB: tl.constexpr,
):
    """Per row not done: the kept uncertain tokens (exact rank and mass), the Gumbel winner of them and
    the surely kept ones; more than CAP uncertain tokens: the exact serial search."""
    row = tl.program_id(0)
    if tl.load(RowI + row * 4) != 0:
        temp = tl.load(Temp + row)
        key = _row_key(Seeds, Pos, row)
        limit, top_p, log_min_p, filtering = _filters(TopK, TopP, LogMinP, row, V)
        m = tl.load(RowF + row * 4)
        mass_limit = tl.load(RowF + row * 4 + 1)
        thr = tl.load(RowF + row * 4 + 2)
        top = tl.load(RowF + row * 4 + 3)
        n_sure = tl.load(RowI + row * 4 + 1)
        n_cand = tl.load(RowI + row * 4 + 2)
        w = tl.load(RowI + row * 4 + 3)
        n_unc = tl.load(UncN + row)
        if n_unc <= CAP:
            c = tl.arange(0, CP)
            ok = c < num_chunks
            cb = tl.load(CandF + (row * num_chunks + c) * 2, mask=ok, other=float("-inf"))
            sure_mass = tl.sum(tl.load(CandF + (row * num_chunks + c) * 2 + 1, mask=ok, other=0.0), 0)
            sure_count = tl.sum(tl.load(CandI + (row * num_chunks + c) * 2 + 1, mask=ok, other=0), 0)
            best, first = tl.max(cb, 0, return_indices=True, return_indices_tie_break_left=True)
            w = tl.load(CandI + (row * num_chunks + first) * 2)  # chunks ascend: the first of equal scores
            k = tl.arange(0, CAP)
            valid = k < n_unc
            xt = tl.load(UncX + row * CAP + k, mask=valid, other=float("-inf"))
            it = tl.load(UncId + row * CAP + k, mask=valid, other=0)
            before_n = tl.zeros([CAP], tl.int32)
            before_m = tl.zeros([CAP], tl.float32)
            for u0 in range(0, CAP, UB):
                u = u0 + tl.arange(0, UB)
                uv = u < n_unc
                xu = tl.load(UncX + row * CAP + u, mask=uv, other=float("-inf"))
                iu = tl.load(UncId + row * CAP + u, mask=uv, other=0)
                ranked = uv[None, :] & ((xu[None, :] > xt[:, None]) | ((xu[None, :] == xt[:, None]) & (iu[None, :] < it[:, None])))
                before_n += tl.sum(ranked.to(tl.int32), 1)
                before_m += tl.sum(tl.where(ranked, tl.exp(xu[None, :] - m), 0.0), 1)
            kept = valid & (sure_count + before_n < limit) & (sure_mass + before_m < mass_limit) & (xt >= thr)
            su = tl.where(kept, xt + _gumbel(key, it), float("-inf"))
            ub, ui = tl.max(su, 0, return_indices=True, return_indices_tie_break_left=True)
            wu = tl.load(UncId + row * CAP + ui)
            # The higher score wins; on equal scores the lower token id (an argmax's first maximum).
            take = (ub > best) | ((ub == best) & (ub > float("-inf")) & (wu < w))
            w = tl.where(take, wu, w)
        else:
            base = Logits + row.to(tl.int64) * stride_row
            lanes = tl.arange(0, BLOCK)
            xw = tl.load(base + w).to(tl.float32) / temp
            if _bin_of(xw, top, NBINS) >= n_cand:
                # Surely cut: draw again among the candidates (a superset of the kept set).
                w, c0, m0 = _draw_pass(base, V, temp, key, lanes, n_cand, top, w, xw, False, False, m, BLOCK, NBINS)
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
    cp = max(2, triton.next_power_of_2(chunks))
    dev = logits.device
    part_f = torch.empty(b, chunks, 4, dtype=torch.float32, device=dev)
    part_i = torch.empty(b, chunks, dtype=torch.int32, device=dev)
    hist = torch.empty(b, chunks, nbp, dtype=torch.int32, device=dev)
    row_f = torch.empty(b, 4, dtype=torch.float32, device=dev)
    row_i = torch.empty(b, 4, dtype=torch.int32, device=dev)
    cand_f = torch.empty(b, chunks, 2, dtype=torch.float32, device=dev)
    cand_i = torch.empty(b, chunks, 2, dtype=torch.int32, device=dev)
    unc_x = torch.empty(b, CAP, dtype=torch.float32, device=dev)
    unc_id = torch.empty(b, CAP, dtype=torch.int32, device=dev)
    unc_n = torch.empty(b, dtype=torch.int32, device=dev)  # zeroed by the threshold kernel, per row it needs
    _first_pass_kernel[(b, chunks)](logits, logits.stride(0), temperature, top_k, top_p, log_min_p, seeds, positions,
                                    part_f, part_i, hist, vocab, CHUNK=CHUNK, BLOCK=BLOCK, NBINS=NBINS, NBP=nbp,
                                    num_warps=8)
    _threshold_kernel[(b,)](logits, logits.stride(0), temperature, top_k, top_p, log_min_p, part_f, part_i, hist, out,
                            row_f, row_i, unc_n, vocab, chunks, CP=cp, NBINS=NBINS, NBP=nbp, num_warps=8)
    _candidate_kernel[(b, chunks)](logits, logits.stride(0), temperature, seeds, positions, row_f, row_i, cand_f,
                                   cand_i, unc_x, unc_id, unc_n, vocab, CHUNK=CHUNK, BLOCK=BLOCK, NBINS=NBINS, CAP=CAP,
                                   num_warps=8)
    _resolve_kernel[(b,)](logits, logits.stride(0), temperature, top_k, top_p, log_min_p, seeds, positions, row_f,
                          row_i, cand_f, cand_i, unc_x, unc_id, unc_n, out, vocab, chunks, CP=cp, BLOCK=FINISH_BLOCK,
                          NBINS=NBINS, CAP=CAP, UB=UB, num_warps=8)
    return out
