"""Placement policies and their registry, on CPU."""

from __future__ import annotations

import pytest

from cluster.messages import GenerateRequest, WorkerStats
from cluster.sampling_params import SamplingParams
from decode_worker.bucketed_graph_runner import bucket_sizes
from router.placement import DECODE_POLICIES, PREFILL_POLICIES, LeastLoadedDecode, WorkerView, padding_waste

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
    assert padding_waste(9, buckets) > padding_waste(16, buckets) == 0.0
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
    assert padding_waste(4, (3, 5)) > 0 and padding_waste(4, (4,)) == 0.0
    assert d.rank(views, REQ, 1)[0].worker_id == "d1"
    assert padding_waste(6, (3, 5)) == 0.0  # beyond the largest bucket: eager, no padding
