"""PlacementWalk on its own (no Router, no Ray, no model): the walk over the ranked decode workers,
local and remote prefill, refusals, the reserve-wait 429 and the no-worker 503, a failed prefill.
The workers are router_fakes.StubWorker."""

from __future__ import annotations

import asyncio

import pytest

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from router.requests.admission import AdmissionController, AdmissionLimits, NoHealthyWorkerError, OverloadedError
from router.stats.arrival_stats import ArrivalStats
from router.placement.kv_index import KVBlockIndex
from router.placed_request import PlacedRequest
from router.placement.placement import PlacementPolicies
from router.requests.placement_walk import PlacementWalk
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient
from router.workers.worker_health import WorkerHealth
from router.workers.worker_set import WorkerSet
from router_fakes import StubWorker


class Harness:
    """A PlacementWalk wired as the Router wires it, recording what it tells the rest of the router."""

    def __init__(self, prefill: list[StubWorker], decode: list[StubWorker], **cfg):
        cfg = RouterConfig(**{"stats_interval_s": 0.01, "reserve_wait_s": 0.05, "prefill_placement": "static", **cfg})
        self.workers = WorkerSet([WorkerClient(w.worker_id, "prefill", w) for w in prefill],
                                 [WorkerClient(w.worker_id, "decode", w) for w in decode])
        self.inflight: dict[str, PlacedRequest] = {}
        self.notified: list[tuple[str, str]] = []
        self.prefilled: list[str] = []
        self.aborted: list[tuple[str | None, str, str | None]] = []
        self.tasks: set[asyncio.Task] = set()
        index = KVBlockIndex()
        policies = PlacementPolicies.create(cfg.prefill_policy, cfg.decode_policy, index)
        self.health = WorkerHealth(self.workers, cfg, index, policies.indexed_roles, self.inflight,
                                   notify=self.notify, rejoin=None, spawn=self.spawn, polled=lambda: None)
        self.admission = AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16, retry_after_s=2))
        self.walk = PlacementWalk(self.workers, cfg, policies, self.admission, self.health, index, ArrivalStats(),
                                  self.inflight, notify=self.notify, prefilled=lambda rs: self.prefilled.append(rs.request_id),
                                  abort_on=self.abort_on, spawn=self.spawn)

    def abort_on(self, wid, rid, error) -> None:
        """Recorded; a prefill worker also gets the call (in the background, as the router sends it),
        so that a prompt dispatched to it and given up is answered."""
        self.aborted.append((wid, rid, error))
        client = self.workers.clients.get(wid)
        if client is not None and client.role == "prefill":
            asyncio.get_running_loop().call_soon(client.handle.abort, rid)

    def notify(self, rs, error) -> None:
        self.notified.append((rs.request_id, error))

    def spawn(self, coro, name=None) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    async def settle(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks))

    def request(self, rid: str, n: int = 20) -> PlacedRequest:
        rs = self.inflight[rid] = PlacedRequest(GenerateRequest(rid, tuple(range(5, 5 + n)),
                                                                SamplingParams(max_tokens=4), 0, 0.0))
        return rs


def test_a_full_decode_worker_is_skipped_for_the_next_and_polled_again():
    async def main():
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        h = Harness([], [d0, d1])
        await h.health.poll_once()
        d0.refuse = True  # the freest-looking worker says no
        rs = h.request("r1")
        await h.walk.place(rs)
        await h.settle()
        assert rs.decode_worker_id == "d1" and rs.local_prefill and rs.prefill_done and h.prefilled == ["r1"]
        assert d0.names() == ["stats", "submit_local", "stats"]  # refused, then asked for fresh stats
        assert "r1" in h.workers.views["d1"].inflight and h.workers.views["d1"].placed_total == 1
    asyncio.run(main())


def test_no_taker_within_the_wait_is_429():
    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0])
        await h.health.poll_once()
        d0.refuse = True
        with pytest.raises(OverloadedError) as e:
            await h.walk.place(h.request("r1"))
        assert "within 0.05s" in str(e.value) and e.value.retry_after_s == 2
        assert not h.workers.views["d0"].placing  # nothing left counted on the worker
    asyncio.run(main())


def test_no_healthy_decode_worker_is_503_unless_a_restart_is_awaited():
    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0])  # never polled: not healthy
        with pytest.raises(NoHealthyWorkerError):
            await h.walk.place(h.request("r1"))
        with pytest.raises(OverloadedError):  # a migration waiting for a restart waits its time instead
            await h.walk.place(h.request("r2"), 0.05, wait_for_restart=True)
    asyncio.run(main())


def test_a_failed_call_counts_against_the_worker_and_the_next_one_takes_it():
    async def main():
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        h = Harness([], [d0, d1], unhealthy_after_failures=1)
        await h.health.poll_once()
        d0.fail = ConnectionError("gone")
        rs = h.request("r1")
        await h.walk.place(rs)
        assert rs.decode_worker_id == "d1" and not h.workers.views["d0"].healthy
    asyncio.run(main())


@pytest.mark.parametrize("remote", [False, True])
def test_a_workers_own_429_refuses_the_request_and_is_no_failure(remote):
    """A decode worker whose grammar compiles are all taken raises CapacityError (through Ray: a
    RayTaskError whose cause it is): the request gets that 429 at once, the worker stays healthy
    and nothing stays counted on it."""
    from ray.exceptions import RayTaskError

    from cluster.errors import CapacityError

    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([StubWorker("p0", "prefill")] if remote else [], [d0], unhealthy_after_failures=1)
        await h.health.poll_once()
        busy = CapacityError("2 structured-output grammars are compiling on this worker (its limit); retry shortly")
        d0.fail = RayTaskError("reserve" if remote else "submit_local", "traceback", busy).as_instanceof_cause()
        rs = h.request("r1")
        with pytest.raises(CapacityError) as refused:
            await h.walk.place(rs)
        assert refused.value is busy and rs.decode_worker_id is None
        v = h.workers.views["d0"]
        assert v.healthy and v.consecutive_failures == 0 and not v.inflight and not v.placing
    asyncio.run(main())


def test_a_remote_prefill_reserves_on_the_decode_worker_then_runs_on_the_prefill_worker():
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), StubWorker("d0", "decode")
        h = Harness([p0], [d0])
        await h.health.poll_once()
        rs = h.request("r1")
        await h.walk.place(rs)
        assert rs.prefill_worker_id == "p0" and "r1" in h.workers.views["p0"].inflight and not rs.prefill_done
        await h.settle()
        assert ("reserve", "r1", "p0") in d0.calls and ("submit", "r1") in p0.calls
        assert rs.prefill_done and rs.prefill_result.ok and h.prefilled == ["r1"]
        assert not h.workers.views["p0"].inflight and not h.workers.views["p0"].placing
        assert not h.notified
    asyncio.run(main())


def test_a_failed_prefill_tells_the_gateway_and_frees_the_decode_side():
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), StubWorker("d0", "decode")
        p0.prefill_ok = False
        h = Harness([p0], [d0])
        await h.health.poll_once()
        await h.walk.place(h.request("r1"))
        await h.settle()
        assert h.notified == [("r1", "prefill broke")] and h.aborted == [("d0", "r1", "prefill broke")]
        assert h.prefilled == ["r1"]  # told all the same: a reply waiting for the notice never waits in vain
    asyncio.run(main())


class SlowReserve(StubWorker):
    """A decode worker whose reservations answer only when the test lets them (`go`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.go = asyncio.Event()

    async def reserve(self, rr):
        self.calls.append(("reserve_called", rr.request.request_id))
        await self.go.wait()
        return super().reserve(rr)


def test_the_prompt_is_dispatched_before_the_decode_worker_answers_its_reservation():
    """The first token's path does not wait for the reservation: P has the prompt while D is still
    reserving; P ships (answers) only once the reservation was handed to it, and only then does the
    walk report the prompt computed."""
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), SlowReserve("d0", "decode")
        h = Harness([p0], [d0])
        await h.health.poll_once()
        rs = h.request("r1")
        placing = asyncio.ensure_future(h.walk.place(rs))
        for _ in range(5):
            await asyncio.sleep(0)
        assert ("submit", "r1") in p0.calls and ("reserve_called", "r1") in d0.calls and not placing.done()
        assert rs.prefill_worker_id == "p0" and rs.dispatched_time is not None
        assert "r1" in p0.unattached and not h.prefilled  # computing; its KV waits for the reservation
        d0.go.set()
        await placing
        await h.settle()
        assert p0.names()[-1] == "attach" and ("attach", "r1", "d0") in p0.calls and not p0.orphans
        assert rs.prefill_done and rs.prefill_result.ok and h.prefilled == ["r1"] and not h.notified
        assert not h.workers.views["p0"].inflight and not h.workers.views["p0"].placing
    asyncio.run(main())


def test_a_refused_reservation_keeps_the_dispatched_prompt_for_the_next_decode_worker():
    """D refused: the prompt P is computing is not lost; the next decode worker's reservation goes to
    the same P (one submit, no abort)."""
    async def main():
        p0 = StubWorker("p0", "prefill")
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        h = Harness([p0], [d0, d1])
        await h.health.poll_once()
        d0.refuse = True
        rs = h.request("r1")
        await h.walk.place(rs)
        await h.settle()
        assert rs.decode_worker_id == "d1" and ("reserve", "r1", "p0") in d0.calls
        assert [c for c in p0.calls if c[0] != "stats"] == [("submit", "r1"), ("attach", "r1", "d1")]
        assert rs.prefill_result.ok and h.prefilled == ["r1"] and not h.notified and not h.aborted
    asyncio.run(main())


def test_a_request_no_decode_worker_takes_is_refused_and_its_dispatched_prompt_dropped():
    """429 as before; P is told to drop the prompt it was computing, and its answer reports nothing
    (no PrefillDone, no failure notice)."""
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), StubWorker("d0", "decode")
        h = Harness([p0], [d0])
        await h.health.poll_once()
        d0.refuse = True
        rs = h.request("r1")
        with pytest.raises(OverloadedError):
            await h.walk.place(rs)
        assert h.aborted == [("p0", "r1", None)] and rs.prefill_worker_id is None
        await h.settle()
        assert [c[0] for c in p0.calls if c[0] != "stats"] == ["submit", "abort"]
        assert not h.prefilled and not h.notified and rs.prefill_result is None
        assert not h.workers.views["p0"].inflight and not h.workers.views["p0"].placing
        assert not h.workers.views["d0"].placing
    asyncio.run(main())


def test_a_decode_worker_choosing_another_prefill_worker_moves_the_prompt_there():
    """The walk decides as before: the next decode worker's choice is another prefill worker (this
    request avoids the (p0, d1) pair), so p1's copy is dropped and p0 computes it."""
    async def main():
        p0, p1 = StubWorker("p0", "prefill"), StubWorker("p1", "prefill")
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        h = Harness([p0, p1], [d0, d1])
        await h.health.poll_once()
        d0.refuse = True
        rs = h.request("r1")
        rs.avoid_pairs.add(("p0", "d0"))  # d0 is offered p1 (refuses), d1 then p0
        place = asyncio.ensure_future(h.walk.place(rs))
        await place
        assert ("p1", "r1", None) in h.aborted
        await h.settle()
        assert [c[0] for c in p1.calls if c[0] != "stats"] == ["submit", "abort"]
        assert [c for c in p0.calls if c[0] != "stats"] == [("submit", "r1"), ("attach", "r1", "d1")]
        assert rs.prefill_worker_id == "p0" and rs.decode_worker_id == "d1" and h.prefilled == ["r1"]
        assert "r1" in h.workers.views["d1"].inflight and not h.workers.views["p1"].inflight
        assert not h.notified
    asyncio.run(main())


def test_a_reservation_that_comes_after_the_client_left_is_handed_to_the_prefill_worker_aborted():
    """Cancelled while D reserved: P drops the prompt (the walk's abort goes out first) and the late
    reservation still reaches P, which tells D no KV comes (so D frees the blocks at once)."""
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), SlowReserve("d0", "decode")
        h = Harness([p0], [d0])
        await h.health.poll_once()
        rs = h.request("r1")
        placing = asyncio.ensure_future(h.walk.place(rs))
        for _ in range(5):
            await asyncio.sleep(0)
        placing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await placing
        assert h.aborted == [("p0", "r1", None)]
        d0.go.set()
        await asyncio.sleep(0.01)
        await h.settle()
        assert [c[0] for c in p0.calls if c[0] != "stats"] == ["submit", "abort", "attach"] and p0.orphans == ["r1"]
        assert not h.prefilled and not h.notified and not h.workers.views["d0"].placing
    asyncio.run(main())


def test_a_prefill_that_fails_while_the_reservation_is_out_is_acted_on_once_placed():
    """P failed the prompt before D answered: as when it fails after (today's order), the placement
    stands, the gateway is told and the decode worker's placement ends with the error."""
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), SlowReserve("d0", "decode")
        p0.prefill_ok = False
        h = Harness([p0], [d0])
        await h.health.poll_once()
        rs = h.request("r1")
        placing = asyncio.ensure_future(h.walk.place(rs))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not h.notified and not h.prefilled  # P's answer is in, the walk has not decided
        d0.go.set()
        await placing
        await h.settle()
        assert rs.decode_worker_id == "d0"
        assert h.notified == [("r1", "prefill broke")] and h.aborted == [("d0", "r1", "prefill broke")]
        assert h.prefilled == ["r1"]
    asyncio.run(main())


class RefusesOnce(StubWorker):
    def reserve(self, rr):
        out = super().reserve(rr)
        self.refuse = False
        return out


def test_the_next_try_ranks_the_prefill_workers_as_before():
    """Between two tries P's view does not count the request (as when P was called only after a
    reservation): two idle prefill workers, d0 refuses once, and the walk's next round picks the same
    p0 again, which keeps the prompt it is computing; p1 is never called."""
    async def main():
        p0, p1 = StubWorker("p0", "prefill"), StubWorker("p1", "prefill")
        d0 = RefusesOnce("d0", "decode")
        h = Harness([p0, p1], [d0])
        await h.health.poll_once()
        d0.refuse = True
        rs = h.request("r1")
        await h.walk.place(rs)
        await h.settle()
        assert [c[0] for c in d0.calls if c[0] == "reserve"] == ["reserve", "reserve"]  # two rounds
        assert [c for c in p0.calls if c[0] != "stats"] == [("submit", "r1"), ("attach", "r1", "d0")]
        assert [c for c in p1.calls if c[0] != "stats"] == [] and not h.aborted
        assert h.workers.views["p0"].placed_total == 1 and h.workers.views["p1"].placed_total == 0
    asyncio.run(main())
