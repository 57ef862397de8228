"""AdmissionController on CPU with hand-made worker views."""

from __future__ import annotations

import pytest

from cluster.errors import InvalidRequestError
from cluster.messages import WorkerStats
from router.admission import AdmissionController, AdmissionLimits
from router.errors import NoHealthyWorkerError, OverloadedError
from router.placement import WorkerView


def view(wid="decode-0", free=100, total=100, healthy=True, running=0):
    v = WorkerView(wid, "decode", WorkerStats(wid, "decode", healthy, free, total, running))
    v.healthy = healthy
    return v


def controller(**kw):
    limits = dict(max_model_len=1024, block_size=16, max_waiting_requests=4, max_inflight_tokens=1000, retry_after_s=3)
    limits.update(kw)
    return AdmissionController(AdmissionLimits(**limits))


def test_context_length_is_400():
    ac = controller()
    with pytest.raises(InvalidRequestError) as e:
        ac.admit("r", 1000, 100, [view()])
    assert e.value.param == "max_tokens" and "1024" in str(e.value)
    ac.admit("ok", 1000, 24, [view()])


def test_never_fits_in_any_worker_is_400():
    ac = controller()
    with pytest.raises(InvalidRequestError):
        ac.admit("r", 500, 500, [view(total=10, free=10)])  # 63 blocks > 10


def test_no_healthy_worker_is_503():
    with pytest.raises(NoHealthyWorkerError):
        controller().admit("r", 10, 10, [view(healthy=False)])
    with pytest.raises(NoHealthyWorkerError):
        controller().admit("r", 10, 10, [])


def test_waiting_limit_then_running_frees_a_slot():
    ac = controller(max_waiting_requests=2)
    ac.admit("a", 10, 10, [view()])
    ac.admit("b", 10, 10, [view()])
    with pytest.raises(OverloadedError) as e:
        ac.admit("c", 10, 10, [view()])
    assert e.value.retry_after_s == 3
    ac.mark_running("a")
    ac.admit("c", 10, 10, [view()])
    assert ac.num_waiting == 2 and ac.num_admitted == 3


def test_inflight_tokens_limit_and_release():
    ac = controller(max_inflight_tokens=100)
    ac.admit("a", 30, 30, [view()])
    with pytest.raises(OverloadedError):
        ac.admit("b", 30, 30, [view()])
    ac.release("a")
    ac.release("a")  # idempotent
    assert ac.inflight_tokens == 0 and ac.num_waiting == 0
    ac.admit("b", 30, 30, [view()])


def test_one_request_above_the_token_limit_runs_alone():
    ac = controller(max_inflight_tokens=100)
    ac.admit("big", 100, 100, [view(total=1000, free=1000)])
    with pytest.raises(OverloadedError):
        ac.admit("small", 1, 1, [view()])


def test_kv_capacity_needs_a_worker_where_the_prompt_fits():
    ac = controller()
    views = [view("d0", free=1, total=100), view("d1", free=2, total=100)]
    ac.admit("fits", 17, 10, views)  # 18 tokens -> 2 blocks: fits on d1
    with pytest.raises(OverloadedError):
        ac.admit("too-big-now", 40, 10, views)  # 3 blocks free nowhere
    views[0].stats = WorkerStats("d0", "decode", True, 50, 100)
    ac.admit("later", 40, 10, views)


def test_a_worker_caching_the_prompt_prefix_needs_only_the_rest_free():
    # 40 + 1 tokens -> 3 blocks; d0 has 1 free but holds the prompt's first 2 blocks in its cache
    # (pinned by the reservation): no 429 while that capacity is there.
    ac = controller()
    views = [view("d0", free=1, total=100), view("d1", free=2, total=100)]
    with pytest.raises(OverloadedError):
        ac.admit("cold", 40, 10, views)
    with pytest.raises(OverloadedError):
        ac.admit("cached-too-little", 40, 10, views, cached_blocks={"d0": 1, "d1": 0})
    ac.admit("cached", 40, 10, views, cached_blocks={"d0": 2})


def test_duplicate_request_id_is_400():
    ac = controller()
    ac.admit("a", 1, 1, [view()])
    with pytest.raises(InvalidRequestError):
        ac.admit("a", 1, 1, [view()])


def test_draining_is_503_before_anything_else():
    from router.admission import DrainingError

    ac = controller()
    ac.check_open()
    ac.draining = True
    with pytest.raises(DrainingError) as e:
        ac.check_open()
    assert isinstance(e.value, NoHealthyWorkerError) and "shutting down" in str(e.value)


def test_no_healthy_decode_worker_is_503_and_the_healthy_ones_are_named():
    ac = controller()
    up, down = view("d0"), view("d1", healthy=False)
    assert ac.check_healthy([up, down]) == [up]
    with pytest.raises(NoHealthyWorkerError, match="no healthy decode worker"):
        ac.check_healthy([down])


def test_a_placement_that_waited_its_time_is_429():
    ac = controller()
    ac.check_placement_wait(1.99, 2.0)
    with pytest.raises(OverloadedError) as e:
        ac.check_placement_wait(2.0, 2.0)
    assert e.value.retry_after_s == 3 and "within 2s" in str(e.value)
