"""AdmissionController on CPU with hand-made worker views."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.errors import InvalidRequestError
from cluster.wire.messages import WorkerStats
from router.requests.admission import AdmissionController, AdmissionLimits
from router.errors import CapacityShortError, DrainingError, NoHealthyWorkerError, OverloadedError
from router.placement.placement import WorkerView


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


def test_admitted_requests_claim_their_room_until_placed():
    """Admissions decided before a placement begins see each other: each claims its blocks and a
    batch slot on the worker with the most room; `placed` hands the count over to the worker's view."""
    ac = controller()
    v = view(free=10, total=100)
    v.stats = WorkerStats("decode-0", "decode", True, 10, 100, max_num_seqs=8)
    ac.admit("a", 60, 10, [v])  # 61 tokens -> 4 blocks
    ac.admit("b", 60, 10, [v])
    with pytest.raises(CapacityShortError):
        ac.admit("c", 60, 10, [v])  # 2 blocks left of the 10
    ac.placed("a")
    v.begin("a", 4, 0)  # now the view counts it (the claim is gone)
    with pytest.raises(CapacityShortError):
        ac.admit("c", 60, 10, [v])
    v.rollback("a")
    ac.admit("c", 60, 10, [v])
    assert ac.num_waiting == 3 and ac.num_admitted == 3
    ac.mark_running("a")
    assert ac.num_waiting == 2


def test_a_full_batch_is_no_room_either():
    ac = controller()
    v = view(free=100, total=100, running=2)
    v.stats = WorkerStats("decode-0", "decode", True, 100, 100, running=2, max_num_seqs=3)
    ac.admit("a", 10, 10, [v])
    with pytest.raises(CapacityShortError, match="batch slot"):
        ac.admit("b", 10, 10, [v])


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


def test_a_cached_prefix_does_not_count_as_room():
    # 40 + 1 tokens -> 3 blocks. d0's free blocks include its evictable cached ones, and the router's
    # index of them may be stale: admitting on the strength of a cached prefix let in requests the
    # worker then refused (a 429 after reserve_wait_s, instead of a wait in the queue).
    ac = controller()
    views = [view("d0", free=1, total=100), view("d1", free=2, total=100)]
    with pytest.raises(OverloadedError):
        ac.admit("cold", 40, 10, views)
    views[1].stats = WorkerStats("d1", "decode", True, 3, 100)
    ac.admit("room", 40, 10, views)


def test_duplicate_request_id_is_400():
    ac = controller()
    ac.admit("a", 1, 1, [view()])
    with pytest.raises(InvalidRequestError):
        ac.admit("a", 1, 1, [view()])


def test_draining_is_503_before_anything_else():
    from router.requests.admission import DrainingError

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


# -- the admission queue (issue 29) -----------------------------------------------------------------

class Capacity:
    """A decode worker with `free` blocks, admitting through one controller: what `try_admit` sees."""

    def __init__(self, ac, free=8, total=100):
        self.ac = ac
        self.v = view(free=free, total=total)
        self.admitted: list[str] = []

    def set_free(self, n):
        self.v.stats = WorkerStats("decode-0", "decode", True, n, self.v.total_blocks)
        self.ac.pump()

    def try_admit(self, rid, prompt=31):  # 32 tokens -> 2 blocks
        def admit():
            self.ac.admit(rid, prompt, 4, [self.v])
            self.admitted.append(rid)
        return admit


def _run(coro):
    return asyncio.run(coro)


def test_a_burst_that_does_not_fit_waits_and_is_admitted_in_order():
    async def main():
        ac = controller(max_waiting_requests=10, queue_timeout_s=5.0)
        cap = Capacity(ac, free=4)
        tasks = [asyncio.ensure_future(ac.enter(f"r{i}", "api-0", cap.try_admit(f"r{i}"))) for i in range(5)]
        await asyncio.sleep(0.01)
        assert cap.admitted == ["r0", "r1"] and ac.num_queued == 3
        for rid in ("r0", "r1"):  # they finish: their blocks come back
            ac.release(rid)
        cap.set_free(4)
        await asyncio.sleep(0.01)
        assert cap.admitted == ["r0", "r1", "r2", "r3"] and ac.num_queued == 1
        cap.set_free(8)
        waited = await asyncio.gather(*tasks)
        assert cap.admitted == [f"r{i}" for i in range(5)] and ac.num_queued == 0
        assert waited[0] == 0.0 and all(w > 0 for w in waited[2:])
    _run(main())


def test_round_robin_between_api_servers():
    """One API server's burst does not hold back another's request: heads are served in turn."""
    async def main():
        ac = controller(max_waiting_requests=20, queue_timeout_s=5.0)
        cap = Capacity(ac, free=0)
        tasks = [asyncio.ensure_future(ac.enter(f"a{i}", "api-0", cap.try_admit(f"a{i}"))) for i in range(6)]
        await asyncio.sleep(0)
        tasks += [asyncio.ensure_future(ac.enter(f"b{i}", "api-1", cap.try_admit(f"b{i}"))) for i in range(2)]
        await asyncio.sleep(0.01)
        cap.set_free(100)
        await asyncio.gather(*tasks)
        assert cap.admitted == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    _run(main())


def test_no_request_overtakes_the_head_that_does_not_fit():
    async def main():
        ac = controller(max_waiting_requests=10, queue_timeout_s=5.0)
        cap = Capacity(ac, free=3)
        big = asyncio.ensure_future(ac.enter("big", "api-0", cap.try_admit("big", prompt=63)))  # 4 blocks
        await asyncio.sleep(0)
        small = asyncio.ensure_future(ac.enter("small", "api-0", cap.try_admit("small")))  # 2 would fit
        await asyncio.sleep(0.01)
        assert cap.admitted == [] and ac.num_queued == 2
        cap.set_free(6)
        await asyncio.gather(big, small)
        assert cap.admitted == ["big", "small"]
    _run(main())


def test_a_full_queue_and_a_wait_past_the_timeout_are_429_with_retry_after():
    async def main():
        ac = controller(max_waiting_requests=2, queue_timeout_s=0.2, retry_after_s=3)
        cap = Capacity(ac, free=0)
        waiting = [asyncio.ensure_future(ac.enter(f"r{i}", "api-0", cap.try_admit(f"r{i}"))) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError, match="max_waiting_requests=2") as full:
            await ac.enter("r2", "api-0", cap.try_admit("r2"))
        assert full.value.retry_after_s == 3
        for t in waiting:
            with pytest.raises(OverloadedError, match="queue_timeout_s") as late:
                await t
            assert late.value.retry_after_s == 3
        assert ac.num_queued == 0 and ac.num_admitted == 0 and cap.admitted == []
    _run(main())


def test_an_expected_wait_past_the_timeout_is_429_at_once():
    """With the rate requests leave the queue known, one whose turn would come after queue_timeout_s
    is refused when it arrives instead of after waiting it out."""
    async def main():
        ac = controller(max_waiting_requests=100, queue_timeout_s=1.0)
        now = time.monotonic()
        ac._left_queue.extend([now - 3.0, now - 2.0, now - 1.0, now])  # one admission a second
        assert ac.expected_wait_s(3) == pytest.approx(3.0)
        cap = Capacity(ac, free=0)
        first = asyncio.ensure_future(ac.enter("r0", "api-0", cap.try_admit("r0")))  # 1 s: waits
        await asyncio.sleep(0)
        assert ac.num_queued == 1
        with pytest.raises(OverloadedError, match="about 2s"):
            await ac.enter("r1", "api-0", cap.try_admit("r1"))
        cap.set_free(10)
        await first
    _run(main())


def test_cancelled_while_queued_leaves_nothing():
    async def main():
        ac = controller(max_waiting_requests=10, queue_timeout_s=5.0)
        cap = Capacity(ac, free=0)
        t = asyncio.ensure_future(ac.enter("r0", "api-0", cap.try_admit("r0")))
        other = asyncio.ensure_future(ac.enter("r1", "api-1", cap.try_admit("r1")))
        await asyncio.sleep(0.01)
        assert ac.num_queued == 2
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert ac.num_queued == 1 and ac.num_admitted == 0 and ac.inflight_tokens == 0
        cap.set_free(10)
        await other
        assert cap.admitted == ["r1"] and ac.num_admitted == 1
        # Admitted by a pump in the instant before its cancellation is handled: the ticket is undone.
        ac.release("r1")
        cap.set_free(0)
        t2 = asyncio.ensure_future(ac.enter("r2", "api-0", cap.try_admit("r2")))
        await asyncio.sleep(0.01)
        cap.set_free(10)  # admits r2 (its future resolves) ...
        t2.cancel()  # ... and its client leaves before its task runs again
        with pytest.raises(asyncio.CancelledError):
            await t2
        assert ac.num_admitted == 0 and ac.inflight_tokens == 0 and ac.num_queued == 0
    _run(main())


def test_a_queued_request_that_can_never_run_or_meets_a_drain_fails_with_its_error():
    async def main():
        ac = controller(max_waiting_requests=10, queue_timeout_s=5.0)
        cap = Capacity(ac, free=0)
        t = asyncio.ensure_future(ac.enter("r0", "api-0", cap.try_admit("r0")))
        await asyncio.sleep(0.01)
        cap.v.healthy = False  # every decode worker gone: 503, not a wait for the timeout
        ac.pump()
        with pytest.raises(NoHealthyWorkerError):
            await t
        cap.v.healthy = True
        t = asyncio.ensure_future(ac.enter("r1", "api-0", cap.try_admit("r1")))
        await asyncio.sleep(0.01)
        ac.draining = True
        with pytest.raises(DrainingError):
            await t
        assert ac.num_queued == 0 and ac.num_admitted == 0
    _run(main())
