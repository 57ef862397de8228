"""Placement policies and their registry, on CPU."""

from __future__ import annotations

import pytest

from cluster.engine.graph_buckets import bucket_sizes, padding_fraction
from cluster.wire.messages import GenerateRequest, WorkerStats
from cluster.sampling.sampling_params import SamplingParams
from router.placement.placement import DECODE_POLICIES, PREFILL_POLICIES, LeastLoadedDecode, WorkerView

REQ = GenerateRequest("r", (1, 2, 3), SamplingParams(), 0, 0.0)


def dview(wid, free=100, total=100, running=0, healthy=True, buckets=(), max_num_seqs=64):
    v = WorkerView(wid, "decode", WorkerStats(wid, "decode", healthy, free, total, running, graph_buckets=buckets,
                                              max_num_seqs=max_num_seqs))
    v.healthy = healthy
    return v


def pview(wid, outstanding=0, healthy=True):
    v = WorkerView(wid, "prefill", WorkerStats(wid, "prefill", healthy, outstanding_prefill_tokens=outstanding))
    v.healthy = healthy
    return v


def test_registry():
    assert {"least_outstanding_tokens", "round_robin"} <= set(PREFILL_POLICIES.names())
    assert {"least_loaded", "round_robin"} <= set(DECODE_POLICIES.names())
    with pytest.raises(ValueError, match="unknown decode policy"):
        DECODE_POLICIES.create("nope")
    with pytest.raises(ValueError, match="already registered"):
        PREFILL_POLICIES.register("round_robin")(object)


def test_prefill_fewest_outstanding_tokens_skips_unhealthy():
    p = PREFILL_POLICIES.create("least_outstanding_tokens")
    views = [pview("p0", 500), pview("p1", 20), pview("p2", 0, healthy=False)]
    assert [v.worker_id for v in p.rank(views, REQ)] == ["p1", "p0"]
    views[1].begin("r9", 0, 1000)  # the router's own placements since the last poll count
    assert p.rank(views, REQ)[0].worker_id == "p0"


def test_decode_prefers_free_kv_and_small_batches():
    d = LeastLoadedDecode()
    views = [dview("d0", free=10, total=100), dview("d1", free=90, total=100), dview("d2", free=95, running=60)]
    assert [v.worker_id for v in d.rank(views, REQ, 1)] == ["d1", "d0", "d2"]
    assert [v.worker_id for v in d.rank(views, REQ, 20)] == ["d1", "d2"]  # d0 lacks the blocks


def test_decode_tie_broken_by_least_graph_padding():
    buckets = tuple(bucket_sizes("vllm", 256))
    d = LeastLoadedDecode(load_quantum=0.1)
    # Same coarse load; one more request makes d0's batch 9 (pads to 16) and d1's 16 (no padding).
    views = [dview("d0", running=8, buckets=buckets, max_num_seqs=256),
             dview("d1", running=15, buckets=buckets, max_num_seqs=256)]
    assert padding_fraction(buckets, 9) > padding_fraction(buckets, 16) == 0.0
    assert d.rank(views, REQ, 1)[0].worker_id == "d1"


def test_idle_equal_workers_alternate():
    d = LeastLoadedDecode()
    views = [dview("d0"), dview("d1")]
    first = d.rank(views, REQ, 1)[0]
    first.placed_total += 1
    assert d.rank(views, REQ, 1)[0].worker_id != first.worker_id


def test_round_robin_rotates():
    rr = DECODE_POLICIES.create("round_robin")
    views = [dview("a"), dview("b"), dview("c")]
    assert [rr.rank(views, REQ, 1)[0].worker_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_each_worker_is_judged_by_its_own_buckets():
    # Explicit buckets (3, 5): batch 4 pads to 5 on d0; d1 captured (4,), so batch 4 pads nothing.
    d = LeastLoadedDecode(load_quantum=1.0)
    views = [dview("d0", running=3, buckets=(3, 5)), dview("d1", running=3, buckets=(4,))]
    assert padding_fraction((3, 5), 4) > 0 and padding_fraction((4,), 4) == 0.0
    assert d.rank(views, REQ, 1)[0].worker_id == "d1"
    assert padding_fraction((3, 5), 6) == 0.0  # beyond the largest bucket: eager, no padding


# -- prefix-aware -----------------------------------------------------------------------------------
def _index_with(holdings: dict[str, list[int]]):
    """A KVBlockIndex fed by real pools: worker -> the prompt it ran (its full blocks are cached)."""
    from cluster.kv.block_pool import PrefixCachingBlockPool
    from cluster.wire.messages import KVCacheEvents
    from router.placement.kv_index import KVBlockIndex

    index = KVBlockIndex()
    for wid, tokens in holdings.items():
        pool = PrefixCachingBlockPool(64, 16, b"salt", event_log_size=64)
        hashes: list = []
        table, cached = pool.allocate_prompt(tokens, len(tokens), hashes)
        pool.cache_full_blocks(table, tokens, hashes, cached, len(tokens))
        index.apply(KVCacheEvents(wid, b"salt", 16, pool.events_since(None, 0)))
    return index


def test_prefix_aware_decode_trades_cache_overlap_against_load():
    prompt = tuple(range(10, 10 + 200))  # 12 full blocks may be hits
    req = GenerateRequest("r", prompt, SamplingParams(), 0, 0.0)
    d = DECODE_POLICIES.create("prefix_aware")
    d.bind_kv_index(_index_with({"d1": list(prompt[:192])}))
    # d1 holds the prompt and is somewhat busier: it still wins.
    views = [dview("d0", free=90), dview("d1", free=70)]
    assert [v.worker_id for v in d.rank(views, req, 13)] == ["d1", "d0"]
    # Much busier: load wins.
    views = [dview("d0", free=90), dview("d1", free=20)]
    assert d.rank(views, req, 13)[0].worker_id == "d0"
    # A prompt nobody holds: least_loaded's order.
    other = GenerateRequest("o", tuple(range(300, 500)), SamplingParams(), 0, 0.0)
    views = [dview("d0", free=90), dview("d1", free=70)]
    assert [v.worker_id for v in d.rank(views, other, 13)] == [v.worker_id for v in LeastLoadedDecode().rank(views, other, 13)]
    # Unbound (no index yet): also least_loaded's order.
    assert [v.worker_id for v in DECODE_POLICIES.create("prefix_aware").rank(views, req, 13)] == ["d0", "d1"]


def test_prefix_aware_prefill_counts_only_the_uncached_tokens():
    prompt = tuple(range(10, 10 + 400))
    req = GenerateRequest("r", prompt, SamplingParams(), 0, 0.0)
    p = PREFILL_POLICIES.create("prefix_aware")
    p.bind_kv_index(_index_with({"p1": list(prompt[:320])}))
    views = [pview("p0", 100), pview("p1", 300)]  # p1: 300 queued + 80 uncached < p0: 100 + 400
    assert [v.worker_id for v in p.rank(views, req)] == ["p1", "p0"]
    views = [pview("p0", 0), pview("p1", 500)]
    assert p.rank(views, req)[0].worker_id == "p0"
