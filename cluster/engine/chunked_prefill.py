"""First-come-first-served chunked prefill: which prompt tokens one packed prefill pass computes.

One rule, used by the reference engine, the prefill worker and the decode worker's local prefill:
walk the waiting queue in order under a token budget; each prompt contributes its next
`min(remaining, budget)` tokens; a prompt cut by the budget ends the batch (it goes first next
pass, so a long prompt is never starved by short ones behind it); a prompt that cannot be admitted
(no KV blocks, batch full) also ends the batch, so nothing overtakes it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence, TypeVar

from cluster.engine.model_runner import PrefillChunk

T = TypeVar("T")


def fcfs_chunks(
    waiting: Iterable[T],
    budget: int,
    progress: Callable[[T], tuple[Sequence[int], int, Sequence[int]]],
    admit: Callable[[T], bool] = lambda _: True,
) -> list[tuple[T, PrefillChunk]]:
    """-> [(item, chunk)] for one pass.

    progress(item) = (all tokens to prefill, tokens already in the cache, block table);
    admit(item) is asked once per item before its chunk is planned (it may allocate the item's
    blocks) and returns False to end the batch there."""
    chunks: list[tuple[T, PrefillChunk]] = []
    for item in waiting:
        if budget <= 0 or not admit(item):
            break
        tokens, done, table = progress(item)
        n = min(len(tokens) - done, budget)
        chunks.append((item, PrefillChunk(tokens[done:done + n], done, table)))
        budget -= n
        if done + n < len(tokens):
            break
    return chunks
