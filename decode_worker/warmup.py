"""DecodeWorkerWarmup: a decode worker's warm-up, run once before it serves (the launcher calls
`DecodeWorker.warmup()` before /ready), so that the first request costs what the hundredth does.

Three parts:
1. every prefill shape class through the local-prefill runner, twice (cluster.warmup: the first
   round cold, the second timed into the worker's prefill rate);
2. the grammar engine (cluster.warmup.warm_grammars): its import, the tokenizer's tables and a first
   compile on the worker's grammar pool, and a first token sampled under a mask;
3. synthetic requests through the real path (submit_local -> chunked local prefill -> decode steps),
   one per sampler variant and one under that grammar, with a prompt longer than the chunk cap while
   another request decodes, so that the capped interleaving, the first-token sampler, a decode step
   of every graph variant and a constrained row's masks have all run.

Nothing of it is published and nothing of it stays counted: the step metrics, the prefix-cache
counters and the local-prefill log start from zero when serving starts; only the measured rates
(prefill per token, decode step per row) are kept, seeded for the router's cost model.

It runs on the caller's thread beside the worker's loop, and like the worker's own API methods it
takes the worker's lock for every look at its scheduler and its block pool.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch

from cluster.block_pool import PrefixCacheStats
from cluster.messages import GenerateRequest
from cluster.warmup import WARMUP_PARAMS, WARMUP_SCHEMA, prefill_shapes, warm_grammars, warm_prefill
from decode_worker.metrics import StepMetrics

if TYPE_CHECKING:  # the worker imports this module to run it
    from decode_worker.decode_worker import DecodeWorker

_POLL_S = 0.002  # how often a wait looks at the scheduler again (and wakes the loop)


class DecodeWorkerWarmup:
    def __init__(self, worker: DecodeWorker, timeout_s: float = 600.0):
        self.worker = worker
        self.timeout_s = timeout_s

    def run(self) -> dict:
        """Warms the worker up; returns what ran (prefill passes, shape classes, requests, seconds).
        Raises RuntimeError if the worker already holds requests, TimeoutError past `timeout_s`."""
        w = self.worker
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        cuda = w.device.type == "cuda"
        with w._lock:
            if w.scheduler.num_seqs:
                raise RuntimeError("warmup() must run before the worker serves")
            w._warming = True  # the loop publishes nothing while it is set
        ids: list[str] = []
        try:
            shapes = prefill_shapes(w.cfg.max_prefill_tokens, w.max_model_len, cuda)
            # The loop holds the lock while it prefills; these passes run beside an idle loop.
            passes = warm_prefill(w.prefill_runner, shapes, self._lend_blocks, self._return_blocks,
                                  w.arch.vocab_size, self._timed)
            grammar_s = warm_grammars(w.grammars, w.arch.vocab_size, w.device, max(0.0, deadline - time.perf_counter()))
            self._run_requests(cuda, deadline, ids)
            if cuda:
                torch.cuda.synchronize(w.device)
        finally:
            with w._lock:
                w._outbox.clear()
                w._last_step_info = (0.0, 0, 0, -1, None)  # no warm-up step record goes out
                w._warming = False
            for r in ids:  # their last deltas were not published: nothing ends their publisher state
                w.publisher.forget(r)
        w.local_prefill.timer.harvest()
        self._reset_serving_counters()
        return {"prefill_passes": passes, "shapes": len(shapes), "requests": len(ids),
                "grammar_seconds": round(grammar_s, 3), "seconds": round(time.perf_counter() - t0, 3),
                "finished_at": time.time()}

    # -- the prefill shapes ---------------------------------------------------------------------
    def _lend_blocks(self, n: int) -> list[int] | None:
        """Blocks for n tokens straight from the pool (None: the shape does not fit this cache)."""
        w = self.worker
        with w._lock:
            pool, need = w.blocks.allocator, w.blocks.blocks_for_tokens(n)
            return pool.allocate(need) if pool.can_allocate(need) else None

    def _return_blocks(self, table: list[int]) -> None:
        with self.worker._lock:
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
            req = GenerateRequest(rid, tuple((11 + 17 * k + 101 * i) % w.arch.vocab_size for k in range(n)), p, i, 0.0)
            if w.submit_local(req) is not None:
                ids.append(rid)
            if i == 0:  # let the short one start decoding, so the long ones prefill beside it
                self._wait_until(lambda: any(x.request_id == rid for x in w.scheduler.running)
                                 or not w.scheduler.holds(rid), deadline)
        self._wait_until(lambda: not any(w.scheduler.holds(r) for r in ids), deadline)

    def _wait_until(self, cond: Callable[[], bool], deadline: float) -> None:
        w = self.worker
        while True:
            with w._lock:
                if cond():
                    return
            if time.perf_counter() > deadline:
                raise TimeoutError("decode worker warm-up did not finish in time")
            w._wake.set()
            time.sleep(_POLL_S)

    def _reset_serving_counters(self) -> None:
        """What the benchmarks and /metrics read counts serving only; the measured rates stay."""
        w = self.worker
        w.metrics = StepMetrics()
        w.blocks.allocator.stats = PrefixCacheStats()  # so do the prefix-cache counters
        w.local_prefill.reset_counters()
