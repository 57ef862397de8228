"""warm_up: a prefill worker's warm-up, run once before it serves (the launcher calls
`PrefillWorker.warmup()` before /ready), so that the first request costs what the hundredth does.

Every prefill shape class twice (cluster.engine.warmup: the first round cold, the second timed into the
worker's pass rate, which seeds the rate the router plans with); then the grammar engine's import, a
first compile and a first token under its mask (warm_grammars), and the first-token sender's
tokenizer. Nothing of it stays in the pool: each pass's blocks go back. Call it before any submit().
"""

from __future__ import annotations

import time

import torch

from cluster.engine.warmup import prefill_shapes, warm_grammars, warm_prefill
from cluster.kv.block_pool import PrefixCachingBlockPool
from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.worker.pass_rate import DevicePassTimer
from prefill_worker.first_token_sender import FirstTokenSender


def warm_up(runner, allocator: PrefixCachingBlockPool, blocks_for_tokens, timer: DevicePassTimer,
            grammars: GrammarCompiler, first_tokens: FirstTokenSender, *, max_prefill_tokens: int, max_model_len: int,
            vocab_size: int, device: torch.device) -> dict:
    """-> the warm-up's record (its stats' `warmup`)."""
    t0 = time.perf_counter()

    def blocks_for(n: int):
        need = blocks_for_tokens(n)
        return allocator.allocate(need) if allocator.can_allocate(need) else None

    def timed(fn, tokens):
        start = timer.start()
        out = fn()
        timer.stop(start, tokens)
        return out

    shapes = prefill_shapes(max_prefill_tokens, max_model_len, device.type == "cuda")
    passes = warm_prefill(runner, shapes, blocks_for, allocator.free, vocab_size, timed)
    grammar_s = warm_grammars(grammars, vocab_size, device)
    first_tokens.load()  # its tokenizer, before the first request needs it
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timer.harvest()
    return {"prefill_passes": passes, "shapes": len(shapes), "grammar_seconds": round(grammar_s, 3),
            "seconds": round(time.perf_counter() - t0, 3), "finished_at": time.time()}
