"""Batched sampling on the device with per-row parameters and no host synchronisation.

A step, for rows that need more than the plain draw (`SamplingParams.needs_features`):
  1. logits processing (cluster.kernels.process_logits, from per-sequence state in cluster.sampling.sampling_state):
     allowed_token_ids, logit_bias, repetition / frequency / presence penalties, bad words, in float32;
  1b. grammar masks of constrained rows (structured output: cluster.kernels.apply_token_bitmask, -inf
     where the row's grammar bans a token), on the processed logits (or, without processing, in place
     on the logits: any step, features or not);
  2. the draw (below) from the processed logits;
  3. the sampled tokens counted into their sequences' state (update_sampling_state);
  4. logprobs of the sampled token and the top ones under the raw logits (cluster.sampling.logprobs).
Rows that need none of it run only the draw, reading the logits as they are (the decode graph has a
variant without steps 1, 3, 4 for batches where no row needs them: cluster-wide the default path).

The draw: greedy rows take the argmax; others a draw from softmax(logits / T) over their top-k /
top-p / min-p set, by Gumbel-max with counter-based noise: row r's noise over the vocabulary is a
hash of (seed_r, position_r, token id) (cluster.kernels.reference.uniform_noise). So a seeded request
samples the same tokens whatever batch it shares (with or without processing in other rows) and on
whichever worker samples it (engine, prefill worker, decode worker on the same device run the same
code), a CUDA graph can replay sampling (no generator state to advance on the host) and nothing is
read back until the caller wants the token ids.

On CUDA these are Triton kernels reading the logits once or twice per row, no sort and no [B, V]
temporaries except the processed logits (cluster/kernels/); elsewhere their torch references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from cluster import kernels
from cluster.kernels.reference import uniform_noise
from cluster.sampling.logprobs import TokenLogprobs, rows_to_logprobs
from cluster.sampling.sampling_params import MAX_LOGPROBS, SamplingParams
from cluster.sampling.sampling_state import SamplingState
from cluster.structured.grammar import bitmask_words
from cluster.structured.request_grammar import RequestGrammar, fill_bitmasks

__all__ = ["SampledTokens", "SamplingTensors", "StepOutputs", "features_state_bytes", "grammar_bitmask", "sample",
           "host_to_device", "sample_step", "sample_tokens", "sample_tokens_async", "take_rows", "uniform_noise",
           "log_min_p"]


def log_min_p(min_p: float) -> float:
    """log(min_p) rounded to float32 (-inf for 0): the sampler's threshold is max + this, computed
    the same way by the kernel and the reference."""
    return float(np.float32(math.log(min_p))) if min_p > 0 else float("-inf")


@dataclass
class SamplingTensors:
    """Per-row parameters on the device. The graph runner keeps static instances of these."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int, <= 0 = disabled
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    log_min_p: torch.Tensor | None = None  # [B] float32, -inf = no min_p

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], device) -> "SamplingTensors":
        return cls(
            temperature=host_to_device([p.temperature for p in params], torch.float32, device),
            # Clamped to int32 (the kernel's type): any k at or above the vocabulary means no limit.
            top_k=host_to_device([min(p.top_k, 2**31 - 1) for p in params], torch.int64, device),
            top_p=host_to_device([p.top_p for p in params], torch.float32, device),
            seeds=host_to_device(seeds, torch.int64, device),
            log_min_p=host_to_device([log_min_p(p.min_p) for p in params], torch.float32, device),
        )


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] without a host sync (`t[list]` uploads its index from pageable memory, which waits for
    the stream); t itself when rows are all of its rows in order."""
    return t if rows == list(range(t.shape[0])) else t[host_to_device(rows, torch.int64, t.device)]


def host_to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or CPU tensor) on `device` without waiting for it: on CUDA through pinned memory,
    non_blocking, so the copy queues behind the work already on the stream instead of syncing the
    host with it (`torch.tensor(..., device="cuda")` copies from pageable memory and waits for the
    stream to drain: after a forward, for the whole pass). The caching host allocator keeps the
    pinned block until the copy has run."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def sample(
    logits: torch.Tensor,  # [B, V], any float dtype
    st: SamplingTensors,
    positions: torch.Tensor,  # [B]: position of the token being sampled (drives the noise)
    use_top_k_top_p: bool | None = None,  # host-side hint: some row filters (the CPU path skips a sort if not)
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [B] int64
    """Greedy rows: argmax. Others: a draw from softmax(logits / T) over their top-k/top-p/min-p set,
    by Gumbel-max (argmax of logits / T plus the row's counter-based Gumbel noise)."""
    return kernels.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, positions, use_top_k_top_p, out,
                          st.log_min_p)


@dataclass
class StepOutputs:
    """Where a features step writes (static buffers in the decode graph, fresh ones on the host path)."""

    processed: torch.Tensor  # [>= B, V] float32
    tokens: torch.Tensor  # [>= B] int64
    logprob: torch.Tensor  # [>= B] float32
    top_ids: torch.Tensor  # [>= B, MAX_LOGPROBS] int64
    top_logprobs: torch.Tensor  # [>= B, MAX_LOGPROBS] float32

    @classmethod
    def allocate(cls, rows: int, vocab: int, device) -> "StepOutputs":
        return cls(torch.empty(rows, vocab, dtype=torch.float32, device=device),
                   torch.zeros(rows, dtype=torch.int64, device=device),
                   torch.zeros(rows, dtype=torch.float32, device=device),
                   torch.zeros(rows, MAX_LOGPROBS, dtype=torch.int64, device=device),
                   torch.zeros(rows, MAX_LOGPROBS, dtype=torch.float32, device=device))


    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def features_state_bytes(rows: int, vocab: int) -> int:
    """Device bytes the decode graph's features variant holds for `rows` batch rows: the per-slot
    sampling state and the step outputs (shapes taken from the allocators themselves, on the meta
    device). The KV pool sizing counts it (cluster.kv.kv_cache.kv_pool_blocks)."""
    meta = torch.device("meta")
    return SamplingState.allocate(rows, vocab, meta).nbytes + StepOutputs.allocate(rows, vocab, meta).nbytes


def sample_step(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor, row_slots: torch.Tensor,
                state: SamplingState, out: StepOutputs, update_state: bool = True,
                bitmask: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One step with logits processing, state update and logprobs (see the module docstring); the
    function the decode graph's features variant captures and the host-side sampler calls. Rows with
    slot -1 sample exactly as `sample` would. `bitmask` = (row_mask [B] int32, masks [S, W] int32):
    grammar masks on the processed logits (logprobs stay the model's). No host sync."""
    b = logits.shape[0]
    processed = kernels.process_logits(logits, row_slots, state, out.processed[:b])
    if bitmask is not None:
        kernels.apply_token_bitmask(processed, *bitmask)
    kernels.sample(processed, st.temperature, st.top_k, st.top_p, st.seeds, positions, None, out.tokens[:b],
                   st.log_min_p)
    if update_state:
        kernels.update_sampling_state(row_slots, out.tokens[:b], state)
    kernels.token_logprobs(logits, out.tokens[:b], MAX_LOGPROBS, out.logprob, out.top_ids, out.top_logprobs)


class SampledTokens:
    """A host-side draw queued on the device (`sample_tokens_async`): `result()` waits for the draw
    itself only (an event after its copies to pinned memory), not for work queued after it, and
    returns host values. On CPU the values are there already."""

    def __init__(self, tokens: torch.Tensor, logprobs: tuple | None, ks: list[int | None]):
        self._n, self._ks = tokens.shape[0], ks
        parts = [tokens] + (list(logprobs) if logprobs is not None else [])
        if tokens.is_cuda:
            # NOTE: pinned + non_blocking, then an event: nothing here waits for the device.
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for h, t in zip(self._host, parts):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = parts, None
        self._has_logprobs = logprobs is not None

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._event is not None:
            self._event.synchronize()  # the draw's copies only; later work on the stream keeps running
        tokens = self._host[0].tolist()
        if not self._has_logprobs or all(k is None for k in self._ks):
            return tokens, [None] * self._n
        lp, ids, top = (h.tolist() for h in self._host[1:])
        return tokens, rows_to_logprobs(lp, ids, top, self._ks)


def grammar_bitmask(grammars: Seq[RequestGrammar | None], vocab_size: int, device
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row_mask [n] int32, masks [k, W] int32) on `device` for the rows with a grammar (each ready),
    None if no row has one: the host-side counterpart of the decode step's static mask buffer."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    assert all(grammars[i].matcher is not None for i in rows), "a constrained row is sampled once its grammar is ready"
    masks = torch.zeros(len(rows), bitmask_words(vocab_size), dtype=torch.int32)
    fill_bitmasks([grammars[i] for i in rows], masks, range(len(rows)))
    row_mask = torch.full((len(grammars),), -1, dtype=torch.int32)
    row_mask[rows] = torch.arange(len(rows), dtype=torch.int32)
    return host_to_device(row_mask, torch.int32, device), host_to_device(masks, torch.int32, device)


def sample_tokens(logits: torch.Tensor, params: "list[SamplingParams]", seeds: list[int], positions: list[int],
                  prompts: Seq[Seq[int]] | None = None, outputs: Seq[Seq[int]] | None = None,
                  grammars: Seq[RequestGrammar | None] | None = None,
                  ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """THE host-side sampling rule after a prefill (a prompt's first token, or the next token of a
    recomputed sequence) and in the reference engine: row i samples the token at position
    `positions[i]` (= the tokens before it) with its own parameters and seed, its prompt `prompts[i]`
    and the tokens it generated so far `outputs[i]` (penalties and bad words read them). Every path
    that samples outside the decode worker's graph calls this, so a seeded request draws the same
    first token wherever it is prefilled; on one device it is the same function the decode graph runs.
    `grammars[i]` (structured output, ready): row i samples only tokens its grammar allows next (the
    caller then advances it with the token, through Sequence.append_token).
    Returns the tokens and, per row, its logprobs (None unless asked). Syncs (returns host values);
    `sample_tokens_async` is the same draw, read later."""
    return sample_tokens_async(logits, params, seeds, positions, prompts, outputs, grammars).result()


def sample_tokens_async(logits: torch.Tensor, params: "list[SamplingParams]", seeds: list[int], positions: list[int],
                        prompts: Seq[Seq[int]] | None = None, outputs: Seq[Seq[int]] | None = None,
                        grammars: Seq[RequestGrammar | None] | None = None) -> SampledTokens:
    """sample_tokens' draw, queued: the caller may queue more work (the next decode step) before it
    reads the result, which then waits for the draw only. The grammar masks are filled on the host
    now, from each grammar's state at the call (the caller advances a grammar only after `result()`)."""
    n = len(params)
    dev = logits.device
    st = SamplingTensors.from_params(params, seeds, dev)
    pos = host_to_device(positions, torch.int64, dev)
    ks = [p.logprobs for p in params]
    masks = grammar_bitmask(grammars, logits.shape[1], dev) if grammars is not None else None
    if not any(p.needs_features for p in params):
        if masks is not None:
            logits = kernels.apply_token_bitmask(logits.clone(), *masks)  # the caller's logits stay as they are
        return SampledTokens(sample(logits, st, pos, any(p.needs_top_k_top_p for p in params)), None, ks)
    prompts = prompts if prompts is not None else [()] * n
    outputs = outputs if outputs is not None else [()] * n
    slotted = [p.needs_features for p in params]
    state = SamplingState.for_rows([p if s else SamplingParams() for p, s in zip(params, slotted)],
                                   [pr if s else () for pr, s in zip(prompts, slotted)],
                                   [o if s else () for o, s in zip(outputs, slotted)], logits.shape[1], dev)
    row_slots = host_to_device([i if s else -1 for i, s in enumerate(slotted)], torch.int32, dev)
    out = StepOutputs.allocate(n, logits.shape[1], dev)
    sample_step(logits, st, pos, row_slots, state, out, update_state=False, bitmask=masks)
    if all(k is None for k in ks):
        return SampledTokens(out.tokens[:n], None, ks)
    return SampledTokens(out.tokens[:n], (out.logprob[:n], out.top_ids[:n], out.top_logprobs[:n]), ks)
