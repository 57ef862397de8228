"""DecodeWorkerWarmup: a decode worker's warm-up, run once before it serves (the launcher calls
`DecodeWorker.warmup()` before /ready), so that the first request costs what the hundredth does.

Three parts:
1. every prefill shape class through the local-prefill runner, twice (cluster.engine.warmup: the first
   round cold, the second timed into the worker's prefill rate);
2. the grammar engine (cluster.engine.warmup.warm_grammars): its import, the tokenizer's tables and a first
   compile on the worker's grammar pool, and a first token sampled under a mask;
3. synthetic requests through the real path (submit_local -> chunked local prefill -> decode steps),
   one per sampler variant and one under that grammar, with a prompt longer than the chunk cap while
   another request decodes, so that the capped interleaving, the first-token sampler, a decode step
   of every graph variant and a constrained row's masks have all run.

Nothing of it is published and nothing of it stays counted: the step metrics, the prefix-cache
counters and the local-prefill log start from zero when serving starts; only the measured rates
(prefill per token, decode step per row) are kept, seeded for the router's cost model.

It runs on the caller's thread beside the worker's loop, and like the worker's own API methods it
takes the worker's lock for every look at its scheduler and its block pool. It gets the parts of the
worker it uses (WarmupParts), not the worker: the worker's `quiet()` pauses its publishing.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from cluster.kv.block_pool import PrefixCacheStats
from cluster.wire.messages import GenerateRequest
from cluster.engine.warmup import WARMUP_PARAMS, WARMUP_SCHEMA, prefill_shapes, warm_grammars, warm_prefill
from cluster.worker.worker_config import WorkerConfig
from decode_worker.block_manager import BlockManager
from decode_worker.local_prefill import LocalPrefill
from decode_worker.scheduler import DecodeScheduler

_POLL_S = 0.002  # how often a wait looks at the scheduler again (and wakes the loop)


@dataclass(frozen=True)
class WarmupParts:
    """What the warm-up uses of a decode worker (DecodeWorker.warmup builds it)."""

    worker_id: str
    cfg: WorkerConfig
    device: torch.device
    vocab_size: int
    max_model_len: int
    lock: Any  # the worker's (reentrant) lock: held for every look at the scheduler and the pool
    scheduler: DecodeScheduler
    blocks: BlockManager
    local_prefill: LocalPrefill
    prefill_runner: Any  # cluster.engine.model_runner.ModelRunner
    grammars: Any  # cluster.structured.GrammarCompiler
    forget: Callable[[str], None]  # drops a request's publisher state
    submit: Callable[[GenerateRequest], int | None]  # DecodeWorker.submit_local
    wake: Callable[[], None]  # wakes the worker's loop
    quiet: Callable[[], AbstractContextManager]  # inside it the worker's loop publishes nothing
    reset_step_metrics: Callable[[], None]  # the step metrics start from zero


class DecodeWorkerWarmup:
    def __init__(self, worker: WarmupParts, timeout_s: float = 600.0):
        self.worker = worker
        self.timeout_s = timeout_s

    def run(self) -> dict:
        """Warms the worker up; returns what ran (prefill passes, shape classes, requests, seconds).
        Raises RuntimeError if the worker already holds requests, TimeoutError past `timeout_s`."""
        w = self.worker
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        cuda = w.device.type == "cuda"
        with w.lock:
            if w.scheduler.num_seqs:
                raise RuntimeError("warmup() must run before the worker serves")
        ids: list[str] = []
        try:
            with w.quiet():  # the loop publishes nothing of the warm-up, not even its step records
                shapes = prefill_shapes(w.cfg.max_prefill_tokens, w.max_model_len, cuda)
                # The loop holds the lock while it prefills; these passes run beside an idle loop.
                passes = warm_prefill(w.prefill_runner, shapes, self._lend_blocks, self._return_blocks,
                                      w.vocab_size, self._timed)
                grammar_s = warm_grammars(w.grammars, w.vocab_size, w.device, max(0.0, deadline - time.perf_counter()))
                self._run_requests(cuda, deadline, ids)
                if cuda:
                    torch.cuda.synchronize(w.device)
        finally:
            for r in ids:  # their last deltas were not published: nothing ends their publisher state
                w.forget(r)
        w.local_prefill.timer.harvest()
        self._reset_serving_counters()
        return {"prefill_passes": passes, "shapes": len(shapes), "requests": len(ids),
                "grammar_seconds": round(grammar_s, 3), "seconds": round(time.perf_counter() - t0, 3),
                "finished_at": time.time()}

    # -- the prefill shapes ---------------------------------------------------------------------
    def _lend_blocks(self, n: int) -> list[int] | None:
        """Blocks for n tokens straight from the pool (None: the shape does not fit this cache)."""
        w = self.worker
        with w.lock:
            pool, need = w.blocks.allocator, w.blocks.blocks_for_tokens(n)
            return pool.allocate(need) if pool.can_allocate(need) else None

    def _return_blocks(self, table: list[int]) -> None:
        with self.worker.lock:
            self.worker.blocks.free_now(table)

    def _timed(self, fn: Callable[[], torch.Tensor], tokens: int) -> torch.Tensor:
        timer = self.worker.local_prefill.timer
        start = timer.start()
        out = fn()
        timer.stop(start, tokens)
        return out

    # -- requests through the serving path -------------------------------------------------------
    def _run_requests(self, cuda: bool, deadline: float, ids: list[str]) -> None:
        """A short request that starts decoding, then one long prompt per sampler variant beside it;
        returns once all are done. `ids` gets each submitted request's id at once (the caller forgets
        their publisher state, whatever happens here)."""
        w = self.worker
        chunk, max_len = w.local_prefill.chunk_tokens, w.max_model_len
        long_prompt = min(chunk + 16, max_len - 64) if cuda else min(24, chunk + 8)
        # The last one decodes under a grammar (compiled above: ready at once).
        params = ([replace(WARMUP_PARAMS[0], max_tokens=12)] + list(WARMUP_PARAMS)
                  + [replace(WARMUP_PARAMS[0], structured=WARMUP_SCHEMA, ignore_eos=False)])
        prompts = [8] + [max(2, long_prompt)] * (len(params) - 1)
        for i, (n, p) in enumerate(zip(prompts, params)):
            rid = f"__warmup-{w.worker_id}-{i}"
            # Distinct prompts: none may find another's blocks in the prefix cache and skip the path.
            req = GenerateRequest(rid, tuple((11 + 17 * k + 101 * i) % w.vocab_size for k in range(n)), p, i, 0.0)
            if w.submit(req) is not None:
                ids.append(rid)
            if i == 0:  # let the short one start decoding, so the long ones prefill beside it
                self._wait_until(lambda: any(x.request_id == rid for x in w.scheduler.running)
                                 or not w.scheduler.holds(rid), deadline)
        self._wait_until(lambda: not any(w.scheduler.holds(r) for r in ids), deadline)

    def _wait_until(self, cond: Callable[[], bool], deadline: float) -> None:
        w = self.worker
        while True:
            with w.lock:
                if cond():
                    return
            if time.perf_counter() > deadline:
                raise TimeoutError("decode worker warm-up did not finish in time")
            w.wake()
            time.sleep(_POLL_S)

    def _reset_serving_counters(self) -> None:
        """What the benchmarks and /metrics read counts serving only; the measured rates stay."""
        w = self.worker
        w.reset_step_metrics()
        w.blocks.allocator.stats = PrefixCacheStats()  # so do the prefix-cache counters
        w.local_prefill.reset_counters()
