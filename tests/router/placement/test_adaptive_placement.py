"""The prefill cost model and the local-vs-remote decision (adaptive and static), on CPU with hand-made
worker views; and the prefill-queue rule of admission."""

from __future__ import annotations

import pytest

from cluster.wire.messages import WorkerStats
from cluster.worker.pass_rate import PassRate
from router.requests.admission import AdmissionController, AdmissionLimits
from router.errors import CapacityShortError
from router.placement.local_prefill_policy import LOCAL_PREFILL_POLICIES, AdaptivePrefill, StaticThreshold
from router.placement.placement import WorkerView
from router.placement.prefill_cost_model import PrefillCostModel

# An 8B-on-H200-like worker: 40k prompt tokens/s + 2 ms per pass; decode step 7 ms + 0.05 ms per row.
PREFILL = PassRate(0.002, 25e-6, 100)
STEP = PassRate(0.007, 5e-5, 100)


def pview(wid="prefill-0", queued=0, rate=PREFILL):
    v = WorkerView(wid, "prefill", WorkerStats(wid, "prefill", True, outstanding_prefill_tokens=queued,
                                              prefill_rate=rate))
    v.healthy = True
    return v


def dview(wid="decode-0", running=0, local_queued=0, rate=PREFILL, step=STEP, cap=256):
    v = WorkerView(wid, "decode", WorkerStats(wid, "decode", True, 1000, 1000, running,
                                              outstanding_prefill_tokens=local_queued, max_num_seqs=128,
                                              prefill_rate=rate, decode_rate=step, local_prefill_chunk_tokens=cap))
    v.healthy = True
    return v


def test_estimates_follow_the_formulas():
    cost = PrefillCostModel(itl_cost_weight=20.0)
    for n in (100, 1000, 4000):
        cost.observe_transfer(n, 0.001 + n * 1e-6)
    p, d = pview(queued=8000), dview(running=10, local_queued=300)
    est = cost.estimate(2048, d, p, mean_output_tokens=128)
    remote = PREFILL.seconds(8000) + PREFILL.seconds(2048) + (0.001 + 2048e-6)
    assert est.remote_s == pytest.approx(remote, rel=1e-6)
    chunks = -(-(300 + 2048) // 256)  # 10 chunks with a decode step of 10 rows between them
    local = (chunks - 1) * STEP.seconds(10) + chunks * PREFILL.overhead_s + 2348 * PREFILL.unit_s
    assert est.local_s == pytest.approx(local)
    stall = 2048 * PREFILL.unit_s + 8 * PREFILL.overhead_s
    assert est.itl_cost_s == pytest.approx(10 * stall / 128 * 20)
    # Nothing decoding: the local queue and the prompt go in one pass, at no cost to anybody.
    idle = cost.estimate(2048, dview(), p, 128)
    assert idle.local_s == pytest.approx(PREFILL.seconds(2048)) and idle.itl_cost_s == 0.0


def test_adaptive_goes_remote_when_the_pool_is_idle_and_the_decode_worker_busy():
    policy = AdaptivePrefill()
    cost = PrefillCostModel()
    choice = policy.choose(2048, dview(running=32), [pview()], cost, 128)
    assert not choice.local and choice.prefill.worker_id == "prefill-0" and choice.reason == "cheaper_remote"


def test_adaptive_goes_local_when_the_prefill_queue_is_deep():
    policy, cost = AdaptivePrefill(), PrefillCostModel()
    # 80k tokens queued on the only prefill worker: ~2 s of wait against ~0.1 s here.
    choice = policy.choose(2048, dview(running=32), [pview(queued=80_000)], cost, 128)
    assert choice.local and choice.reason == "cheaper_local"
    assert choice.estimate.remote_s > 1.9 and choice.estimate.local_total_s < 1.0
    # The static threshold does not look at queues.
    static = StaticThreshold(threshold=0)
    assert not static.choose(2048, dview(running=32), [pview(queued=80_000)], cost, 128).local


def test_adaptive_short_prompts_and_idle_decode_workers_stay_local():
    policy, cost = AdaptivePrefill(), PrefillCostModel()
    for n in (100, 1000, 4000):
        cost.observe_transfer(n, 0.002 + n * 2e-6)
    # A short prompt on a lightly loaded decode worker: one chunk, no transfer.
    assert policy.choose(128, dview(running=2), [pview()], cost, 128).local
    # Any prompt on an idle decode worker: same compute, no transfer, nobody to stall.
    assert policy.choose(2048, dview(running=0), [pview()], cost, 128).local
    # The ITL cost grows with the batch it would stall: the same short prompt goes remote at 64 rows.
    assert not policy.choose(128, dview(running=64), [pview()], cost, 128).local
    # At or below the threshold: local whatever the estimates say.
    assert AdaptivePrefill(threshold=256).choose(200, dview(running=64), [pview()], cost, 128).reason == "short"


def test_adaptive_local_cost_counts_the_decode_workers_own_local_queue():
    policy, cost = AdaptivePrefill(), PrefillCostModel()
    busy_here = dview(running=8, local_queued=60_000)
    assert not policy.choose(1024, busy_here, [pview(queued=4000)], cost, 128).local


def test_unmeasured_paths_and_no_prefill_worker():
    policy, cost = AdaptivePrefill(), PrefillCostModel()
    assert policy.choose(2048, dview(), [], cost, 128).reason == "no_prefill_worker"
    unmeasured_p = pview(rate=None)
    assert policy.choose(2048, dview(running=4), [unmeasured_p], cost, 128).local  # only local is measured
    c = policy.choose(2048, dview(running=4, rate=None), [pview()], cost, 128)
    assert not c.local and c.reason == "unmeasured"
    assert set(LOCAL_PREFILL_POLICIES.names()) == {"adaptive", "static"}


def test_router_own_placements_count_in_the_queues():
    cost = PrefillCostModel()
    p = pview(queued=0)
    assert cost.remote_wait_s(p) == 0.0
    p.begin("r1", 0, 40_000)  # placed a moment ago, not in the polled stats yet
    assert cost.remote_wait_s(p) == pytest.approx(PREFILL.seconds(40_000))
    p.ack("r1")
    p.update(WorkerStats("prefill-0", "prefill", True, outstanding_prefill_tokens=40_000, prefill_rate=PREFILL),
             issued_at=p.placing["r1"].acked_at + 1e-6)  # a poll issued after the ack: counted once
    assert p.outstanding_prefill_tokens == 40_000


def test_admission_refuses_when_every_prefill_path_is_too_deep():
    ac = AdmissionController(AdmissionLimits(max_model_len=8192, block_size=16, max_prefill_queue_s=2.0))
    cost = PrefillCostModel()
    prefill, decode = [pview(queued=200_000)], [dview(running=4, local_queued=150_000)]
    wait = cost.best_queue_wait_s(prefill, decode)
    assert wait > 2.0
    with pytest.raises(CapacityShortError, match="prefill queues"):
        ac.admit("r", 100, 10, decode, wait)
    decode.append(dview("decode-1"))  # an idle decode worker is a path with no wait
    assert cost.best_queue_wait_s(prefill, decode) == 0.0
    ac.admit("r", 100, 10, decode, cost.best_queue_wait_s(prefill, decode))


def test_each_path_pays_only_for_the_tokens_it_computes():
    """A multi-turn prompt the decode worker caches almost whole (the previous turn and its answer)
    costs it a short local pass and no transfer; the same prompt uncached goes remote. A prefix the
    prefill worker caches shortens the remote path the same way."""
    policy, cost = AdaptivePrefill(), PrefillCostModel()
    for n in (100, 1000, 4000):
        cost.observe_transfer(n, 0.001 + n * 1e-6)
    d, p = dview(running=32), pview()
    assert not policy.choose(2048, d, [p], cost, 128).local  # uncached: remote (as above)
    choice = policy.choose(2048, d, [p], cost, 128, cached={"decode-0": 1920})
    assert choice.local and choice.reason == "cheaper_local"
    full = cost.estimate(2048, d, p, 128)
    hit = cost.estimate(2048, d, p, 128, cached_on_d=1920, cached_on_p=1024)
    assert hit.local_s == pytest.approx(cost.local_s(d, 128)) and hit.itl_cost_s < full.itl_cost_s / 10
    assert hit.remote_s == pytest.approx(PREFILL.seconds(1024) + cost.transfer_s(128))
