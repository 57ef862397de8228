"""WorkerHealth on its own (no Router, no Ray, no model): polls, liveness, dead actors and their
peers, restarts and rejoins, shared refreshes. The workers are router_fakes.StubWorker."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import RayActorError

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from router.placement.kv_index import KVBlockIndex
from router.placed_request import PlacedRequest
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient
from router.workers import worker_health
from router.workers.worker_health import WorkerHealth
from router.workers.worker_set import WorkerSet
from router_fakes import StubWorker


class Harness:
    """A WorkerHealth wired as the Router wires it, recording what it tells the rest of the router."""

    def __init__(self, prefill: list[StubWorker], decode: list[StubWorker], rejoin=None, **cfg):
        self.stubs = {w.worker_id: w for w in [*prefill, *decode]}
        self.workers = WorkerSet([WorkerClient(w.worker_id, "prefill", w) for w in prefill],
                                 [WorkerClient(w.worker_id, "decode", w) for w in decode])
        self.inflight: dict[str, PlacedRequest] = {}
        self.notified: list[tuple[str, str]] = []
        self.rejoined: list[tuple[str, str, list[str]]] = []
        self.tasks: set[asyncio.Task] = set()
        self.polls = 0

        async def default_rejoin(wid, role, peers):
            self.rejoined.append((wid, role, peers))

        self.health = WorkerHealth(self.workers, RouterConfig(**cfg), KVBlockIndex(), frozenset(), self.inflight,
                                   notify=lambda rs, error: self.notified.append((rs.request_id, error)),
                                   rejoin=rejoin or default_rejoin, spawn=self.spawn, polled=self.count_poll)

    def spawn(self, coro, name=None) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def count_poll(self) -> None:
        self.polls += 1

    async def settle(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks))

    def place(self, rid: str, worker_id: str) -> PlacedRequest:
        rs = self.inflight[rid] = PlacedRequest(GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=4), 0, 0.0))
        rs.decode_worker_id = worker_id
        self.workers.views[worker_id].inflight.add(rid)
        return rs


def test_missed_polls_make_a_worker_unhealthy_and_fail_its_requests():
    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0], unhealthy_after_failures=3)
        await h.health.poll_once()
        v = h.workers.views["d0"]
        assert v.healthy and h.health.polled_once and h.polls == 1
        rs = h.place("r1", "d0")
        d0.fail = ConnectionError("no answer")
        for _ in range(2):
            await h.health.poll_once()
        assert v.healthy and v.consecutive_failures == 2 and not h.notified
        await h.health.poll_once()
        assert not v.healthy and not v.inflight
        assert h.notified == [("r1", "decode worker d0 stopped answering")] and rs.lost == h.notified[0][1]
        await h.settle()
    asyncio.run(main())


def test_a_dead_actor_fails_at_once_and_its_peers_hear_of_it():
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), StubWorker("d0", "decode")
        h = Harness([p0], [d0], migrate_on_worker_death=False)
        await h.health.poll_once()
        rs = h.place("r1", "d0")
        d0.fail = RayActorError()
        await h.health.poll_once()
        await h.settle()
        assert not h.workers.views["d0"].healthy
        assert ("peer_died", "d0") in p0.calls  # before its requests move, its peers drop their transfers
        assert h.notified == [("r1", "decode worker d0 died")] and rs.lost is None  # migration off: not moved
    asyncio.run(main())


def test_a_worker_that_reports_itself_unhealthy_fails_its_requests():
    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0])
        await h.health.poll_once()
        h.place("r1", "d0")
        d0.healthy = False
        await h.health.poll_once()
        assert h.notified == [("r1", "decode worker d0 reported itself unhealthy")]
    asyncio.run(main())


def test_a_restarted_worker_is_held_back_until_it_rejoined():
    async def main():
        go = asyncio.Event()
        joined = []

        async def rejoin(wid, role, peers):
            joined.append((wid, role, peers))
            await go.wait()

        p0, d0 = StubWorker("p0", "prefill"), StubWorker("d0", "decode")
        h = Harness([p0], [d0], rejoin=rejoin)
        await h.health.poll_once()
        assert h.health.incarnation("d0") == "i0"
        h.place("r1", "d0")
        d0.incarnation = "i1"  # Ray restarted it between two polls
        await h.health.poll_once()
        v = h.workers.views["d0"]
        assert not v.healthy and h.notified == [("r1", "decode worker d0 died")]  # a death first
        await h.health.poll_once()  # still rejoining: not healthy, and not rejoined twice
        await asyncio.sleep(0)
        assert not v.healthy and joined == [("d0", "decode", ["p0"])]
        go.set()
        await h.settle()
        assert v.healthy and h.health.incarnation("d0") == "i1"
        assert ("peer_died", "d0") in p0.calls
    asyncio.run(main())


def test_a_failed_rejoin_is_retried_from_a_later_poll():
    async def main():
        attempts = []

        async def rejoin(wid, role, peers):
            attempts.append(wid)
            if len(attempts) == 1:
                raise RuntimeError("transport not ready")

        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0], rejoin=rejoin)
        await h.health.poll_once()
        d0.incarnation = "i1"
        await h.health.poll_once()
        await h.settle()
        await h.health.poll_once()  # too soon after the failure: not retried yet
        await h.settle()
        assert attempts == ["d0"] and not h.workers.views["d0"].healthy and h.health.incarnation("d0") == "i0"
        await asyncio.sleep(1.05)
        await h.health.poll_once()
        await h.settle()
        assert attempts == ["d0", "d0"] and h.workers.views["d0"].healthy and h.health.incarnation("d0") == "i1"
    asyncio.run(main())


class FrozenClock:
    """worker_health's `time`, its monotonic() moved by hand (asyncio's own clock keeps running)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_concurrent_refreshes_share_one_poll(monkeypatch):
    clock = FrozenClock()  # "a moment ago" is 20 ms: a loaded 2-core runner once spent that between two lines
    monkeypatch.setattr(worker_health, "time", clock)

    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0])
        await asyncio.gather(*(h.health.refresh(1.0) for _ in range(5)))
        assert d0.names() == ["stats"] and h.polls == 1
        clock.now += 0.019
        await h.health.refresh(1.0)  # right after a poll: nothing new to learn
        assert h.polls == 1
        clock.now += 0.002
        await h.health.refresh(1.0)  # a moment later: polled again
        assert h.polls == 2
    asyncio.run(main())


@pytest.mark.parametrize("error,alive", [(None, True), (ConnectionError("slow"), True), (RayActorError(), False)])
def test_alive_asks_the_worker_now(error, alive):
    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0], unhealthy_after_failures=1)
        await h.health.poll_once()
        d0.fail = error
        assert await h.health.alive("d0") is alive
        assert h.workers.views["d0"].healthy is (error is None)  # a failed call counts against it
        assert await h.health.alive("gone") is False
    asyncio.run(main())


def test_lost_on_asks_whether_the_worker_dropped_the_request():
    async def main():
        d0 = StubWorker("d0", "decode")
        h = Harness([], [d0, StubWorker("d1", "decode")])
        await h.health.poll_once()
        d0.lost_ids.add("r1")
        assert await h.health.lost_on("d0", "r1") and not await h.health.lost_on("d0", "r2")
        h.workers.clients["d1"].handle = object()  # a double without the method: not lost
        assert not await h.health.lost_on("d1", "r1")
        d0.fail = RayActorError()
        assert await h.health.lost_on("d0", "r2") and not h.workers.views["d0"].healthy  # dead: lost
        await h.settle()
    asyncio.run(main())


# -- issue 29: restarts together, deaths during a rejoin, the restart limit --------------------------

def test_workers_restarting_together_get_their_pair_in_the_rejoin():
    """A prefill and a decode worker restart at once: each rejoin began while the other was
    unhealthy; the one that finishes second forms the pair with the first (it sees it joined)."""
    async def main():
        release = {"p0": asyncio.Event(), "d0": asyncio.Event()}
        h = None

        async def rejoin(wid, role, peers):
            h.rejoined.append((wid, role, list(peers)))
            if wid in release and not release[wid].is_set():
                await release[wid].wait()
        p0, d0, d1 = StubWorker("p0", "prefill"), StubWorker("d0", "decode"), StubWorker("d1", "decode")
        h = Harness([p0], [d0, d1], rejoin=rejoin)
        await h.health.poll_once()
        p0.incarnation, d0.incarnation = "i1", "i1"  # both restarted between two polls
        await h.health.poll_once()
        assert not h.workers.views["p0"].healthy and not h.workers.views["d0"].healthy
        await asyncio.sleep(0.01)
        assert sorted(h.rejoined) == [("d0", "decode", []), ("p0", "prefill", ["d1"])]
        release["p0"].set()  # the prefill worker's rejoin finishes first ...
        await asyncio.sleep(0.05)
        release["d0"].set()  # ... then the decode worker's: it sees p0 joined and forms their pair
        for _ in range(50):
            await asyncio.sleep(0.01)
        assert ("d0", "decode", ["p0"]) in h.rejoined
        await h.health.poll_once()
        assert all(h.workers.views[w].healthy for w in ("p0", "d0", "d1"))
    asyncio.run(main())


def test_a_peer_that_died_during_a_rejoin_is_not_taken_for_joined():
    """A restarted prefill worker rejoins; a decode worker dies meanwhile and fails that rejoin. The
    retry pairs with the live peers, and not then with the dead one, whose last stats still name the
    incarnation it served as (the rejoin sent a hello to its dead endpoint and waited
    transfer_timeout_s: chaos "rejoin_peer_death", 17 s against 12)."""
    async def main():
        h = None
        d1_died = asyncio.Event()

        async def rejoin(wid, role, peers):
            h.rejoined.append((wid, role, list(peers)))
            if "d1" in peers and len(h.rejoined) == 1:
                await d1_died.wait()
                raise RuntimeError("peer d1 died while forming the KV pair")
        p0, d0, d1 = StubWorker("p0", "prefill"), StubWorker("d0", "decode"), StubWorker("d1", "decode")
        h = Harness([p0], [d0, d1], rejoin=rejoin)
        await h.health.poll_once()
        p0.incarnation = "i1"  # p0 restarted
        await h.health.poll_once()
        await asyncio.sleep(0.01)
        d1.fail = RayActorError()  # d1 dies while p0's rejoin forms its pairs
        await h.health.poll_once()
        assert not h.workers.views["d1"].healthy
        d1_died.set()
        await asyncio.sleep(0.01)
        h.health._rejoin_after.clear()  # (the retry's back-off, 1 s)
        await h.health.poll_once()
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert h.rejoined == [("p0", "prefill", ["d0", "d1"]), ("p0", "prefill", ["d0"])], h.rejoined
    asyncio.run(main())


def test_a_death_is_told_to_the_peers_that_are_rejoining_too():
    async def main():
        p0, d0, d1 = StubWorker("p0", "prefill"), StubWorker("d0", "decode"), StubWorker("d1", "decode")
        h = Harness([p0], [d0, d1])
        await h.health.poll_once()
        h.workers.views["p0"].healthy = False  # p0 is rejoining (not healthy yet)
        d1.fail = RayActorError()
        await h.health.poll_once()
        await asyncio.sleep(0.01)
        assert ("peer_died", "d1") in [c[:2] for c in p0.calls]
    asyncio.run(main())


def test_a_worker_past_its_restart_limit_is_gone():
    async def main():
        d0, d1 = StubWorker("d0", "decode"), StubWorker("d1", "decode")
        h = Harness([], [d0, d1], worker_max_restarts=1)
        await h.health.poll_once()
        d0.incarnation = "i1"  # its one restart
        await h.health.poll_once()
        await asyncio.sleep(0.01)
        await h.health.poll_once()
        assert h.workers.views["d0"].healthy and not h.health.gone
        assert h.health.may_come_back("decode") is False  # nothing is down
        d0.fail = RayActorError()  # and dies again: no restart left
        await h.health.poll_once()
        assert h.health.gone == {"d0"} and not h.health.may_come_back("decode")
        d1.fail = RayActorError()  # d1 has its restart left: it may come back
        await h.health.poll_once()
        assert h.health.gone == {"d0"} and h.health.may_come_back("decode")
    asyncio.run(main())


def test_the_launchers_gone_check_names_a_worker_killed_for_good():
    async def main():
        d0, d1 = StubWorker("d0", "decode"), StubWorker("d1", "decode")
        h = Harness([], [d0, d1], worker_max_restarts=-1)  # restarts always: only Ray knows it is gone

        async def gone(wid):
            return wid == "d0"
        h.health.gone_check = gone
        await h.health.poll_once()
        d0.fail = RayActorError()
        await h.health.poll_once()
        await asyncio.sleep(0.01)
        assert h.health.gone == {"d0"}
    asyncio.run(main())


def test_the_poll_loop_polls_idle_workers_every_idle_poll_s_and_busy_ones_every_time(monkeypatch):
    """The loop's polls (idle_too=False) skip a worker that holds nothing by its last stats and has
    nothing of the router's on it, until its last poll is IDLE_POLL_S old; a request placed on it
    makes it busy again for the very next poll; refresh()'s full poll asks every worker."""
    from router.workers import worker_health

    async def main():
        d0, d1 = StubWorker("d0", "decode"), StubWorker("d1", "decode")
        h = Harness([], [d0, d1], stats_interval_s=1e-3)
        polls = lambda w: w.names().count("stats")  # noqa: E731
        await h.health.poll_once(idle_too=False)  # never polled: both
        assert polls(d0) == polls(d1) == 1
        h.place("r1", "d1")
        full = h.health.fresh_as_of
        for _ in range(3):
            await h.health.poll_once(idle_too=False)
        assert (polls(d0), polls(d1)) == (1, 4)  # d0 idle, d1 holds r1
        assert h.health.fresh_as_of == full and h.polls == 4  # a partial poll is not a fresh picture of all
        h.workers.views["d0"].refused = True  # refused a placement: ranked again only after a poll
        await h.health.poll_once(idle_too=False)
        assert (polls(d0), polls(d1)) == (2, 5)
        h.place("r2", "d0")
        await h.health.poll_once(idle_too=False)
        assert (polls(d0), polls(d1)) == (3, 6)
        for w, rid in (("d0", "r2"), ("d1", "r1")):
            h.workers.views[w].inflight.discard(rid)
        await h.health.poll_once(idle_too=False)
        assert (polls(d0), polls(d1)) == (3, 6)  # both idle now
        await h.health.poll_once()  # refresh()'s poll, for a decision that wants fresh stats: every worker
        assert (polls(d0), polls(d1)) == (4, 7) and h.health.fresh_as_of > full
        monkeypatch.setattr(worker_health, "IDLE_POLL_S", 0.0)
        await asyncio.sleep(2e-3)  # their last poll is now max(IDLE_POLL_S, stats_interval_s) old
        await h.health.poll_once(idle_too=False)
        assert (polls(d0), polls(d1)) == (5, 8)
        d0.fail = RayActorError()  # dies idle: the next poll that reaches it finds it
        await asyncio.sleep(2e-3)
        await h.health.poll_once(idle_too=False)
        assert not h.workers.views["d0"].healthy
    asyncio.run(main())
