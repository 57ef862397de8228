"""Warm-up of the prefill path before a worker serves: the shapes it will see, run twice.

The first request of each shape class used to pay for CUDA/cuBLAS initialisation, the caching
allocator growing, Triton autotuning and lazy imports (a TTFT p99 of 1.4 s at 2 req/s on the first
run, 150 ms on the next). Workers call `warm_prefill` from their `warmup()`, which the launcher
calls before /ready: the first round is cold and untimed, the second round is timed into the
worker's PassRateMeter so that the router's cost model has real rates from the first request on.

The shape classes (`prefill_shapes`): single prompts of every power of two up to the prefill
budget, packed batches of several prompts filling it, and a continuation chunk (a prompt whose
first part is already cached, as chunked prefill runs it). On CPU only the smallest of each class
run: there is nothing to autotune, only code paths to touch.

Structured output (`warm_grammars`): the grammar engine's import (xgrammar: seconds), its tables of
the tokenizer's vocabulary (a second for 128k tokens) and a first compile happen on the worker's
grammar pool before it serves, and a first token is sampled under that grammar's mask, so the first
structured request waits for its own compile only.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.sampling.sampler import sample_tokens
from cluster.sampling.sampling_params import SamplingParams
from cluster.structured import GrammarCompiler, StructuredOutput

# One pass = chunks of (new tokens, tokens already cached).
Shape = tuple[tuple[int, int], ...]

# Every sampler variant the decode graphs capture (greedy, sample, filtered), as request parameters.
WARMUP_PARAMS = (
    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.8, top_k=8, top_p=0.9, ignore_eos=True),
)


# What agents' schemas are made of (an object with an enum, an array, a number, a required key).
WARMUP_SCHEMA = StructuredOutput.json_schema({
    "type": "object", "required": ["kind"],
    "properties": {"kind": {"enum": ["a", "b"]}, "items": {"type": "array", "items": {"type": "integer"}},
                   "score": {"type": "number"}}})
WARMUP_GRAMMAR_ID = "__warmup-grammar"


def prefill_shapes(max_prefill_tokens: int, max_model_len: int, cuda: bool) -> list[Shape]:
    budget = max(1, min(max_prefill_tokens, max_model_len - 1))
    if not cuda:
        small = min(16, budget)
        return [((small, 0),), ((max(1, small // 2), 0),) * 2, ((small, small),)] if budget >= 2 * small \
            else [((small, 0),)]
    shapes: list[Shape] = []
    n = 16
    while n < budget:
        shapes.append(((n, 0),))
        n *= 2
    shapes.append(((budget, 0),))
    for each in (128, 512):  # packed batches of equal prompts filling the budget
        k = budget // each
        if k >= 2:
            shapes.append(((each, 0),) * k)
    if budget + 256 <= max_model_len - 1:  # a later chunk of a long prompt: attends to cached KV
        shapes.append(((budget, 256),))
    return shapes


def warm_prefill(runner: ModelRunner, shapes: Sequence[Shape], blocks_for: Callable[[int], list[int] | None],
                 release: Callable[[list[int]], None], vocab_size: int,
                 timed: Callable[[Callable[[], torch.Tensor], int], torch.Tensor] | None = None) -> int:
    """Runs every shape twice (the second round through `timed(fn, tokens)` when given) and samples
    its logits with every sampler variant. blocks_for(n) lends blocks for n tokens (None: the
    shape does not fit this cache and is skipped); release gives them back. Returns passes run."""
    passes = 0
    for round_ in range(2):
        for shape in shapes:
            tables = []
            try:
                for new, cached in shape:
                    table = blocks_for(new + cached)
                    if table is None:
                        break
                    tables.append(table)
                if len(tables) < len(shape):
                    continue
                chunks = [PrefillChunk([(7 + 31 * i) % vocab_size for i in range(cached, cached + new)], cached, t)
                          for (new, cached), t in zip(shape, tables)]
                tokens = sum(new for new, _ in shape)

                def run():
                    return runner.prefill(chunks)
                logits = timed(run, tokens) if timed is not None and round_ == 1 else run()
                for p in WARMUP_PARAMS:
                    rows = len(shape)
                    sample_tokens(logits, [p] * rows, [passes + r for r in range(rows)],
                                  [new + cached for new, cached in shape])
                passes += 1
            finally:
                for t in tables:
                    release(t)
    return passes


def warm_grammars(grammars: GrammarCompiler, vocab_size: int, device: torch.device, timeout_s: float = 300.0) -> float:
    """Compiles WARMUP_SCHEMA on the compiler's pool (which builds the backend first: the engine's
    import and the tokenizer's tables) and samples a first token under its mask on `device` (the
    host-side mask path, cluster.sampling.sampler.sample_tokens). Returns the seconds it took; raises
    RuntimeError if the grammar failed, TimeoutError past `timeout_s`."""
    t0 = time.perf_counter()
    g = grammars.grammar_for(WARMUP_SCHEMA, WARMUP_GRAMMAR_ID)
    if not g.wait(timeout_s):
        if g.error is not None:
            raise RuntimeError(f"grammar warm-up failed: {g.error}")
        raise TimeoutError(f"the warm-up grammar did not compile in {timeout_s:g}s")
    logits = torch.zeros(1, vocab_size, device=device)
    tokens, _ = sample_tokens(logits, [WARMUP_PARAMS[0]], [0], [1], grammars=[g])
    if not g.accept(tokens[0]):  # the mask let through a token its grammar refuses: a broken mask path
        raise RuntimeError(f"grammar warm-up: token {tokens[0]} sampled under the mask is refused by the grammar")
    return time.perf_counter() - t0
