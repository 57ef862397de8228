"""The startup heap of a serving process, frozen once it is warm (gc.freeze), so that the cyclic garbage
collector's oldest generation never walks it again.

Why: a serving process (a worker actor, an API server, the launcher's router) ends its start-up with a
few hundred thousand long-lived objects (torch, Ray, the tokenizer, the model's modules, the block
pool), and what it allocates per request is freed by refcounting, nearly all of it. A
full (generation-2) collection is stop-the-world and walks that whole heap: CPython runs one each time
the objects that survived into it grow by a quarter, so under a steady load it comes at a fixed count
of requests, stalling that process for the walk. On one H200 (loadtest/results/ttft_h200.md) every
request in flight waited 212-487 ms at one instant of each run, in the router's own parts (admission),
38.4 s after the warm-up in two runs of the same load: a fixed count of requests, as such a pause comes.
An A/B on one H100 (loadtest/results/startup_heap_h100.md): the same 4-user load's p99 was 280.6 ms
(252 ms in admission) without the freeze and 35.6 ms with it.
On the 2-core CPU one full collection of the launcher, an API server or a worker actor took 200-400 ms
once its start-up was done (its cost is `full_collection_ms` below).
vLLM freezes the same heaps (API server, engine core, GPU worker after warm-up).

Frozen objects are never collected as cycles (refcounting still frees them). A cycle made before the
freeze whose end matters - a KV pair's gloo channel, whose sockets must close so the peer's receives
end; a decode worker's old incarnation restarted in place, which holds a KV cache - goes through
`collect_including_frozen()`.

Only a process that pdserve owns freezes (a worker actor's, an API server's, `pdserve serve`'s), never
one that embeds a cluster (ServingCluster.start_in_thread: a test, a notebook).
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> dict:
    """Collects what start-up left, then freezes every object alive. Returns the record: the objects
    frozen, what a full collection cost before the freeze (what a later one would have cost, at the
    least) and what one costs right after it. Both are wall times of the gc.collect() call: in a
    process whose other threads are busy they include waits for the GIL (on the 2-core CPU the pass
    itself after the freeze took under 0.1 ms, its call 30-66 ms)."""
    t0 = time.perf_counter()
    gc.collect()
    before_ms = (time.perf_counter() - t0) * 1e3
    gc.freeze()
    t1 = time.perf_counter()
    gc.collect()
    after_ms = (time.perf_counter() - t1) * 1e3
    return {"frozen_objects": gc.get_freeze_count(), "full_collection_ms": round(before_ms, 2),
            "after_freeze_ms": round(after_ms, 2)}


def heap_frozen() -> bool:
    return gc.get_freeze_count() > 0


def collect_including_frozen() -> None:
    """A full collection that reaches the frozen heap too, then the freeze again (of what is alive). For
    the rare cycle made before the freeze that must end now; it costs one full walk of the heap."""
    frozen = heap_frozen()
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
