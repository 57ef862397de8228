"""Logits processing before sampling (penalties, logit_bias, allowed_token_ids, bad words) and the
per-slot state update after it, in two Triton kernels reading the tables of cluster.sampling.sampling_state.

Must equal `cluster.kernels.reference.process_logits` and `update_sampling_state` (the same
operations rounded the same way: IEEE division, no fused multiply-add).

`_process_kernel`, one program per (row, chunk of CHUNK tokens): a row without a slot is copied to
float32; a row with one reads its logits once with its counts and bitmasks (allowed tokens, prompt
tokens) alongside, applies the allowed mask and the penalties and writes float32; then, after a
barrier (other threads of the program wrote those addresses), the logit_bias entries in its chunk are
recomputed from the raw logit (+ bias, then the penalties), and after another barrier each bad word
whose prefix matches the slot's history bans its last token. No host sync; tables are indexed by slot.

`_update_kernel`, one program per row: the sampled token is counted in its slot and appended to the
slot's history (a barrier between reading the history and writing it shifted).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.sampling.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS

CHUNK = 8192
BLOCK = 2048


@triton.jit
def _allowed_mask(x, AllowedRow, offs, m):
    word = tl.load(AllowedRow + (offs >> 5), mask=m, other=0)
    return tl.where(((word >> (offs & 31)) & 1) != 0, x, float("-inf"))


@triton.jit
def _penalise(x, CountsRow, PromptRow, offs, m, rep, freq, pres):
    c = tl.load(CountsRow + offs, mask=m, other=0)
    word = tl.load(PromptRow + (offs >> 5), mask=m, other=0)
    seen = (c > 0) | (((word >> (offs & 31)) & 1) != 0)
    y = tl.where(seen, tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
    return y - freq * c.to(tl.float32) - pres * (c > 0).to(tl.float32)


@triton.jit
def _process_kernel(
    Logits, stride_l, Out, stride_o, RowSlot, Counts, Prompt, Allowed, FParams, IParams,
    BiasIds, BiasVals, BadIds, BadLen, History, V, W,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, NBW: tl.constexpr,
    LBW: tl.constexpr,
):
    row = tl.program_id(0)
    lo = tl.program_id(1) * CHUNK
    src = Logits + row.to(tl.int64) * stride_l
    dst = Out + row.to(tl.int64) * stride_o
    lanes = tl.arange(0, BLOCK)
    slot = tl.load(RowSlot + row)
    if slot < 0:
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            m = offs < V
            tl.store(dst + offs, tl.load(src + offs, mask=m, other=0.0).to(tl.float32), mask=m)
    else:
        s = slot.to(tl.int64)
        flags = tl.load(IParams + s * 4)
        use_allowed = (flags & 1) != 0
        use_pen = (flags & 2) != 0
        rep = tl.load(FParams + s * 4)
        freq = tl.load(FParams + s * 4 + 1)
        pres = tl.load(FParams + s * 4 + 2)
        counts_row = Counts + s * V
        prompt_row = Prompt + s * W
        allowed_row = Allowed + s * W
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            m = offs < V
            x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
            if use_allowed:
                x = _allowed_mask(x, allowed_row, offs, m)
            if use_pen:
                x = _penalise(x, counts_row, prompt_row, offs, m, rep, freq, pres)
            tl.store(dst + offs, x, mask=m)
        tl.debug_barrier()  # the bias entries below overwrite addresses other threads just wrote
        j = tl.arange(0, NBP)
        n_bias = tl.load(IParams + s * 4 + 1)
        ids = tl.load(BiasIds + s * NB + j, mask=j < n_bias, other=-1)
        here = (j < n_bias) & (ids >= lo) & (ids < lo + CHUNK)
        x = tl.load(src + ids, mask=here, other=0.0).to(tl.float32)
        if use_allowed:
            x = _allowed_mask(x, allowed_row, ids, here)
        x = x + tl.load(BiasVals + s * NB + j, mask=here, other=0.0)
        if use_pen:
            x = _penalise(x, counts_row, prompt_row, ids, here, rep, freq, pres)
        tl.store(dst + ids, x, mask=here)
        tl.debug_barrier()  # a bad word's ban must land after a bias entry for the same token
        n_bad = tl.load(IParams + s * 4 + 2)
        n_gen = tl.load(IParams + s * 4 + 3)
        w = tl.arange(0, NBW)
        t = tl.arange(0, LBW)
        length = tl.load(BadLen + s * NBW + w, mask=w < n_bad, other=0)
        plen = length - 1  # tokens that must be the last ones generated
        words = tl.load(BadIds + (s * NBW + w[:, None]) * LBW + t[None, :],
                        mask=(w < n_bad)[:, None] & (t[None, :] < length[:, None]), other=0)
        need = (t[None, :] < plen[:, None]) & (w < n_bad)[:, None]
        hist = tl.load(History + s * LBW + t[None, :] + LBW - plen[:, None], mask=need, other=-1)
        same = tl.where(need, words == hist, 1)
        match = (tl.min(same.to(tl.int32), 1) > 0) & (w < n_bad) & (n_gen >= plen)
        last = tl.sum(tl.where(t[None, :] == plen[:, None], words, 0), 1)
        hit = match & (last >= lo) & (last < lo + CHUNK)
        tl.store(dst + last, tl.full([NBW], float("-inf"), tl.float32), mask=hit)


@triton.jit
def _update_kernel(RowSlot, Tokens, Counts, History, IParams, V, LBW: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(RowSlot + row)
    if slot >= 0:
        s = slot.to(tl.int64)
        tok = tl.load(Tokens + row)
        c = Counts + s * V + tok
        tl.store(c, tl.load(c) + 1)
        n = IParams + s * 4 + 3
        tl.store(n, tl.load(n) + 1)
        t = tl.arange(0, LBW)
        h = tl.load(History + s * LBW + t + 1, mask=t < LBW - 1, other=0)
        h = tl.where(t == LBW - 1, tok.to(tl.int32), h)
        tl.debug_barrier()  # every thread has read the history before any writes it shifted
        tl.store(History + s * LBW + t, h)


def process_logits(logits: torch.Tensor, row_slots: torch.Tensor, state, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same arguments and result as the reference; `out` [>= B, V] float32 (row stride free)."""
    b, vocab = logits.shape
    assert logits.stride(1) == 1 and row_slots.dtype == torch.int32
    out = torch.empty(b, vocab, dtype=torch.float32, device=logits.device) if out is None else out
    assert out.stride(1) == 1 and out.dtype == torch.float32
    if b == 0:
        return out
    _process_kernel[(b, triton.cdiv(vocab, CHUNK))](
        logits, logits.stride(0), out, out.stride(0), row_slots, state.counts, state.prompt, state.allowed,
        state.fparams, state.iparams, state.bias_ids, state.bias_vals, state.bad_ids, state.bad_len, state.history,
        vocab, state.prompt.shape[1],
        CHUNK=CHUNK, BLOCK=BLOCK, NB=MAX_LOGIT_BIAS, NBP=triton.next_power_of_2(MAX_LOGIT_BIAS), NBW=MAX_BAD_WORDS,
        LBW=MAX_BAD_WORD_TOKENS, num_warps=8, enable_fp_fusion=False,
    )
    return out


def update_sampling_state(row_slots: torch.Tensor, tokens: torch.Tensor, state) -> None:
    b = row_slots.shape[0]
    if b:
        _update_kernel[(b,)](row_slots, tokens, state.counts, state.history, state.iparams, state.vocab_size,
                             LBW=MAX_BAD_WORD_TOKENS, num_warps=1)
