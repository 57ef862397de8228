"""Shared-prefix traffic for the prefix-cache benchmark, and the reuse it offers in theory.

Two workloads, as token-id prompts (exact lengths, no tokenizer in the way):

- **multi-turn chat**: `sessions` conversations of `turns` turns behind one long system prompt. Turn k
  sends system + (user_1, answer_1, ..., user_{k-1}, answer_{k-1}) + user_k. Answers are recorded
  text (synthetic tokens), not what the model generates, as a replayed conversation benchmark does:
  the cache can then only reuse what was *sent* before, which makes the theoretical reuse exact.
- **few-shot template**: every request is one fixed instruction + examples template, then its own
  question.

Requests come in dispatch order: turn-major (every session's turn 1, then every turn 2, ...), so a
session's next turn is sent long after its previous one; the driver still waits for the previous turn
to finish before sending the next (a client cannot send turn k+1 before it read answer k).

`theoretical_reuse` runs the prompts, in that order, through a `PrefixCachingBlockPool` that never
evicts: the fraction of prompt tokens a perfect cache would serve under the pool's own hit rule
(whole blocks, never the last token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from cluster.kv.block_pool import PrefixCachingBlockPool

TOKEN_LO, TOKEN_HI = 10, 410  # inside the demo tokenizer's vocabulary, clear of its special tokens


@dataclass(frozen=True)
class WorkloadRequest:
    session: int  # requests of one session are sent in order, each after the previous finished
    turn: int
    prompt: tuple[int, ...]
    max_tokens: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def multi_turn(sessions: int = 32, turns: int = 6, system_tokens: int = 1500, user_tokens: tuple[int, int] = (40, 160),
               answer_tokens: tuple[int, int] = (80, 240), output_tokens: int = 64, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens)
    history = [list(system) for _ in range(sessions)]
    out = []
    for turn in range(turns):
        for s in range(sessions):
            history[s] += _tokens(rng, rng.randint(*user_tokens))
            out.append(WorkloadRequest(s, turn, tuple(history[s]), output_tokens))
            history[s] += _tokens(rng, rng.randint(*answer_tokens))
    return out


def few_shot(requests: int = 128, template_tokens: int = 1200, question_tokens: tuple[int, int] = (30, 120),
             output_tokens: int = 64, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    template = _tokens(rng, template_tokens)
    # Each request is its own session: nothing orders them.
    return [WorkloadRequest(i, 0, tuple(template + _tokens(rng, rng.randint(*question_tokens))), output_tokens)
            for i in range(requests)]


def theoretical_reuse(prompts: Sequence[Sequence[int]], block_size: int) -> tuple[int, int]:
    """(prompt tokens a never-evicting cache serves, prompt tokens) over the prompts in order."""
    total_blocks = sum(-(-len(p) // block_size) for p in prompts) + 1
    pool = PrefixCachingBlockPool(total_blocks + 1, block_size)
    for p in prompts:
        hashes: list = []
        table, cached = pool.allocate_prompt(p, len(p), hashes)
        pool.cache_full_blocks(table, p, hashes, cached, len(p))
        pool.free(table)
    return pool.stats.hits, pool.stats.queries
