"""WorkerHealth: the router's stats polls of its workers, and what it does when one fails or restarts.

- Polls: every `stats_interval_s`, each worker's `stats()` updates its WorkerView (admission and
  placement decide on those); with a `prefix_aware` policy each healthy worker's block events
  (`kv_events`) then feed the router's KVBlockIndex. `refresh()` polls every worker at once (shared
  by concurrent callers) when a decision needs fresher stats than the last poll.
- An idle worker (healthy, holding no request by its last stats, and none of the router's requests
  placed on it) is polled every IDLE_POLL_S only: nothing changes on it until the router places a
  request there, which makes it busy again for the next poll. (An idle 1P+2D cluster spent ~7 % of a
  core on 30 polls a second, on both ends of the Ray calls.) A worker that dies idle is found within
  IDLE_POLL_S, or at once by the call that places a request on it.
- Liveness: a worker that misses `unhealthy_after_failures` polls, or that Ray reports dead (at
  once), or that reports itself unhealthy, is marked unhealthy; the requests placed on it are failed
  (`fail_requests_on`: with migration on they are marked lost and their gateways told, and the
  gateway's Migrate moves them). A dead worker's peers of the other role are told at once
  (`peer_died`), so that they drop their KV transfers with it before the requests move.
- Restarts: a worker's stats carry the incarnation of its process (`extra["incarnation"]`, new on
  every Ray restart of its actor). A new incarnation is kept unhealthy until the launcher's `rejoin`
  (KV transport, warm-up) succeeded; a restart the router never saw fail is a death first. Workers of
  the other role that restarted at the same time get their pair in the same rejoin. A worker that
  dies once more after as many restarts as `worker_max_restarts` allows is gone (`gone`, /ready,
  `pdserve:worker_gone`): the cluster serves on the others, and migrations stop waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from cluster.wire.messages import WorkerStats
from router.placement.kv_index import KVBlockIndex
from router.stats.metrics import RouterMetrics
from router.placed_request import Notify, PlacedRequest
from router.placement.placement import WorkerView
from router.router_config import RouterConfig
from router.workers.worker_client import ActorDead
from router.workers.worker_set import WorkerSet

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # the poll interval of an idle worker (at least stats_interval_s)

# (worker id, role, ids of the healthy workers of the other role): makes a restarted worker (a new
# incarnation) ready to serve again: joins its KV transport, warms it up. Raises if it could not.
Rejoin = Callable[[str, str, list[str]], Awaitable[None]]
# Runs a coroutine in the background, on the router's books (Router.stop waits for it, then cancels it).
Spawn = Callable[..., asyncio.Task]
# (worker id) -> whether the worker is dead for good (Ray will not restart it again): the launcher's.
GoneCheck = Callable[[str], Awaitable[bool]]


class WorkerHealth:
    def __init__(self, workers: WorkerSet, cfg: RouterConfig, kv_index: KVBlockIndex, indexed_roles: frozenset[str],
                 inflight: dict[str, PlacedRequest], notify: Notify, rejoin: Rejoin, spawn: Spawn,
                 polled: Callable[[], None], metrics: RouterMetrics | None = None,
                 gone_check: GoneCheck | None = None):
        """indexed_roles: roles whose block events are polled (a policy ranks them by cache overlap).
        inflight: the router's admitted requests (shared). notify: tells a request's gateway that its
        worker failed it. rejoin: the launcher's. polled: called after every complete poll."""
        self.workers = workers
        self.cfg = cfg
        self.kv_index = kv_index
        self.indexed_roles = indexed_roles
        self.inflight = inflight
        self.notify = notify
        self.rejoin = rejoin
        self.spawn = spawn
        self.polled = polled
        self.metrics = metrics
        self.polled_once = False
        self.fresh_as_of = -1e9  # when the last completed poll of every worker was issued
        self._poller: asyncio.Task | None = None
        self._refreshing: asyncio.Future | None = None
        self._incarnations: dict[str, str] = {}  # worker id -> the incarnation it serves as
        # worker id -> the incarnation it served as when it last failed: that one never pairs again
        self._failed_incarnation: dict[str, str | None] = {}
        self._rejoining: dict[str, asyncio.Task] = {}
        self._rejoin_after: dict[str, float] = {}  # worker id -> when a failed rejoin may be retried
        self._restarts: dict[str, int] = {}  # worker id -> restarts seen (new incarnations answering)
        self.gone: set[str] = set()  # workers dead past their restart limit: never back
        self.gone_check = gone_check
        self._gone_asked: dict[str, float] = {}  # worker id -> when gone_check was last asked
        self._polled_at: dict[str, float] = {}  # worker id -> when its last stats poll was issued

    # -- polls --------------------------------------------------------------------------------------
    def start_polling(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop(), name="router-stats")

    def stop_polling(self) -> asyncio.Task | None:
        """Cancels the poll loop; returns its task (to await) if it ran."""
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
        return poller

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.stats_interval_s)
            try:
                await self.poll_once(idle_too=False)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("stats poll failed")

    async def poll_once(self, idle_too: bool = True) -> None:
        """Polls every worker, or (`idle_too` False: the poll loop) the busy ones and the idle ones
        whose last poll is IDLE_POLL_S old."""
        issued = time.monotonic()
        views = list(self.workers.views.values())
        if not idle_too:
            idle_s = max(IDLE_POLL_S, self.cfg.stats_interval_s)
            views = [v for v in views if not self._idle(v) or issued - self._polled_at.get(v.worker_id, -1e9) >= idle_s]
        await asyncio.gather(*(self.poll(v) for v in views))
        if len(views) == len(self.workers.views):  # (the views that stayed idle are as fresh as this)
            self.fresh_as_of = max(self.fresh_as_of, issued)
        self.polled_once = True
        self.polled()

    @staticmethod
    def _idle(v: WorkerView) -> bool:
        """Nothing on the worker, and nothing the router did there that a poll has still to confirm
        (the view's `running` and `outstanding_prefill_tokens` count its stats and its placements)."""
        return (v.healthy and not v.refused and not v.draining and not v.inflight and not v.released
                and not v.running and not v.outstanding_prefill_tokens)

    async def refresh(self, max_wait_s: float | None = None) -> None:
        """Polls every worker now, unless a poll went out a moment ago; concurrent callers share
        one poll (a burst of refusals does not become a burst of polls). Returns after at most
        `max_wait_s` even if the poll has not answered yet (it goes on and updates the views)."""
        if self._refreshing is None:
            if time.monotonic() - self.fresh_as_of < min(0.02, self.cfg.stats_interval_s / 4):
                return
            self._refreshing = fut = asyncio.ensure_future(self.poll_once())

            def done(_):
                if self._refreshing is fut:
                    self._refreshing = None
            fut.add_done_callback(done)
        # asyncio.wait neither cancels the shared poll nor swallows our own cancellation.
        await asyncio.wait({self._refreshing}, timeout=max_wait_s)

    def _poll_timeout(self, longest: float) -> float:
        return max(1.0, min(self.cfg.call_timeout_s, longest))

    async def poll(self, v: WorkerView) -> None:
        """One stats poll of the worker (and of its block events, if indexed)."""
        client = self.workers.clients.get(v.worker_id)
        if client is None:  # removed meanwhile
            return
        issued = self._polled_at[v.worker_id] = time.monotonic()
        try:
            stats = await client.stats(timeout=self._poll_timeout(10.0))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.call_failed(v, e)
        else:
            was_healthy = v.healthy
            v.update(stats, issued)
            if self._restarted(v, stats, was_healthy):
                v.healthy = False  # until it rejoined
            elif was_healthy and not v.healthy:
                self.kv_index.drop(v.worker_id)
                self.fail_requests_on(v, "reported itself unhealthy")
            if v.healthy and v.role in self.indexed_roles:
                await self._poll_kv_events(v)
        if self.metrics and v.worker_id in self.workers.views:
            self.metrics.observe_worker(v.stats, v.worker_id, v.role, v.healthy)

    async def _poll_kv_events(self, v: WorkerView) -> None:
        """Brings the index up to date with the worker's cached blocks. The index only ranks workers,
        so a failed poll just leaves it a poll behind (health is the stats poll's business)."""
        try:
            ev = await self.workers.clients[v.worker_id].kv_events(*self.kv_index.position(v.worker_id),
                                                                   timeout=self._poll_timeout(10.0))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("kv_events of %s failed: %s", v.worker_id, e)
        else:
            self.kv_index.apply(ev)

    # -- liveness -----------------------------------------------------------------------------------
    async def alive(self, worker_id: str) -> bool:
        """Asks the worker now (a dead Ray actor answers at once with an error)."""
        v = self.workers.views.get(worker_id)
        if v is None:  # taken out of service
            return False
        if v.healthy:
            try:
                await self.workers.clients[worker_id].stats(timeout=self._poll_timeout(5.0))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.call_failed(v, e)
                return not isinstance(e, ActorDead)
        return v.healthy

    async def lost_on(self, worker_id: str, worker_request_id: str) -> bool:
        """Whether the worker dropped the request through a failure of its own (or is dead)."""
        client = self.workers.clients.get(worker_id)
        if client is None:
            return False
        try:
            return bool(await client.lost(worker_request_id, timeout=self._poll_timeout(5.0)))
        except asyncio.CancelledError:
            raise
        except ActorDead as e:
            self.call_failed(self.workers.views[worker_id], e)
            return True
        except Exception:  # noqa: BLE001 - a worker without the method (test doubles), or not answering
            return False

    def call_failed(self, v: WorkerView, e: BaseException) -> None:
        """A call to the worker failed: counts against its health (a dead Ray actor fails it at once)."""
        v.consecutive_failures += 1
        dead = isinstance(e, ActorDead)  # also while Ray restarts it (ActorUnavailableError)
        if v.healthy and (dead or v.consecutive_failures >= self.cfg.unhealthy_after_failures):
            log.error("worker %s is unhealthy: %s: %s", v.worker_id, e.__class__.__name__, e)
            self._worker_failed(v, dead, f"Ray reports worker {v.worker_id} dead")
        if dead and v.worker_id not in self.gone:
            if self._past_restart_limit(v.worker_id):
                self._mark_gone(v)
            elif self.gone_check is not None and time.monotonic() - self._gone_asked.get(v.worker_id, -1e9) > 1.0:
                self._gone_asked[v.worker_id] = time.monotonic()
                self.spawn(self._ask_gone(v), name=f"gone-{v.worker_id}")

    async def _ask_gone(self, v: WorkerView) -> None:
        try:
            gone = await self.gone_check(v.worker_id)
        except Exception as e:  # noqa: BLE001 - asked again at the next failed call
            log.debug("asking whether %s is gone failed: %s", v.worker_id, e)
            return
        if gone and v.worker_id not in self.gone and v.worker_id in self.workers.views and not v.healthy:
            self._mark_gone(v)

    def _mark_gone(self, v: WorkerView) -> None:
        self.gone.add(v.worker_id)
        log.error("worker %s died past its restart limit (%d restarts seen): it is gone; the cluster serves on "
                  "the others", v.worker_id, self._restarts.get(v.worker_id, 0))
        if self.metrics:
            self.metrics.worker_gone(v.worker_id, v.role)

    def _past_restart_limit(self, worker_id: str) -> bool:
        limit = self.cfg.worker_max_restarts
        return limit >= 0 and self._restarts.get(worker_id, 0) >= limit

    def may_come_back(self, role: str) -> bool:
        """Some worker of `role` is unhealthy but not gone: Ray may still bring it back."""
        return self.cfg.workers_restart and any(
            not self.workers.views[w].healthy and w not in self.gone for w in self.workers.ids(role))

    def _worker_failed(self, v: WorkerView, dead: bool, why: str) -> None:
        v.healthy = False
        self._failed_incarnation[v.worker_id] = self._incarnations.get(v.worker_id)
        self.kv_index.drop(v.worker_id)
        if dead:
            self._tell_peers(v, why)
        self.fail_requests_on(v, "died" if dead else "stopped answering")

    def _tell_peers(self, v: WorkerView, why: str) -> None:
        """A worker died: every worker of the other role drops its KV transfers with it now (a decode
        worker frees the blocks it reserved for them), instead of after its transport's heartbeat
        timeout. Before the requests are moved, so their new placements find the blocks free. Also
        the peers that are not healthy now: one rejoining (a restarted worker forming its pairs)
        must not wait for a pair with the dead one until the rendezvous gives up."""
        other = "decode" if v.role == "prefill" else "prefill"
        for wid in self.workers.ids(other):
            client = self.workers.clients[wid]

            async def tell(client=client):
                try:
                    await client.peer_died(v.worker_id, why, timeout=self.cfg.call_timeout_s)
                except Exception as e:  # noqa: BLE001 - its own heartbeat check still finds out
                    log.warning("telling %s that %s died failed: %s", client.worker_id, v.worker_id, e)
            self.spawn(tell())

    def fail_requests_on(self, v: WorkerView, why: str) -> None:
        """Ends (or, with migration on, moves) every request placed on a worker that failed: its
        gateway stops taking the dead placement's tokens and asks to migrate it (or ends it)."""
        for rid in list(v.inflight):
            rs = self.inflight.get(rid)
            if rs is None:
                continue
            msg = f"{v.role} worker {v.worker_id} {why}"
            if self.cfg.migrate_on_worker_death and rs.lost is None:
                rs.lost = msg
            self.notify(rs, msg)
        v.inflight.clear()

    # -- restarts -----------------------------------------------------------------------------------
    def incarnation(self, worker_id: str) -> str | None:
        """The process incarnation the worker serves as: changes once a restarted worker rejoined."""
        return self._incarnations.get(worker_id)

    def forget(self, worker_id: str) -> None:
        """The worker was taken out of service."""
        self._incarnations.pop(worker_id, None)

    def _restarted(self, v: WorkerView, stats: WorkerStats, was_healthy: bool) -> bool:
        """Whether the worker answering is a new incarnation that has not rejoined yet (Ray restarted
        its actor: no KV transport, cold). Starts its rejoin; once that succeeded, the next poll
        marks it healthy and the router places on it again. A restart the router never saw fail (it
        happened between two polls) is a death first: what the old incarnation held is gone."""
        wid, inc = v.worker_id, stats.extra.get("incarnation")
        known = self._incarnations.setdefault(wid, inc)
        if inc == known:
            return False
        if inc != v.restart_seen:  # the first poll of this incarnation: Ray restarted the worker once more
            v.restart_seen = inc
            self._restarts[wid] = self._restarts.get(wid, 0) + 1
            if wid in self.gone:  # it was not past its limit after all (a restart the router missed)
                self.gone.discard(wid)
                if self.metrics:
                    self.metrics.worker_gone(wid, v.role, False)
        if was_healthy:
            log.error("worker %s restarted (incarnation %s) between two polls", wid, inc)
            self._worker_failed(v, True, f"worker {wid} restarted")
        if wid not in self._rejoining and time.monotonic() >= self._rejoin_after.get(wid, 0.0):
            log.warning("worker %s answers as a new incarnation (%s): rejoining it", wid, inc)
            self._rejoining[wid] = self.spawn(self._rejoin(v, inc), name=f"rejoin-{wid}")
        return True

    def _joined_peers(self, role: str) -> list[str]:
        """Workers of the other role that serve: healthy, or rejoined and waiting for the poll that
        marks them healthy (their current incarnation is the one the router has, and it has not
        failed since: a dead worker's last stats still name the incarnation it served as, and a
        rejoin that took it for joined waited out a hello to its dead endpoint, transfer_timeout_s)."""
        other = "decode" if role == "prefill" else "prefill"
        out = []
        for w in self.workers.ids(other):
            v = self.workers.views[w]
            known = self._incarnations.get(w)
            if v.healthy or (w not in self._rejoining and v.stats.extra.get("incarnation") is not None
                             and known == v.stats.extra.get("incarnation")
                             and self._failed_incarnation.get(w, "") != known):
                out.append(w)
        return out

    async def _rejoin(self, v: WorkerView, inc: str) -> None:
        wid = v.worker_id
        peers = self.workers.healthy_peers(v.role)
        t0 = time.monotonic()
        try:
            await self.rejoin(wid, v.role, peers)
            # A peer that restarted together with this worker (each saw the other unhealthy when its
            # rejoin began) and has rejoined since: the pair between them is formed now too. No await
            # between the last look and taking the new incarnation below: of two workers rejoining
            # together, the one that finishes second sees the first one joined.
            while more := [p for p in self._joined_peers(v.role) if p not in peers]:
                await self.rejoin(wid, v.role, more)
                peers = peers + more
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - retried a moment later, from a poll
            log.error("worker %s restarted but did not rejoin: %s: %s", wid, e.__class__.__name__, e)
            self._rejoin_after[wid] = time.monotonic() + 1.0
        else:
            if self.workers.clients.get(wid) is not None:
                self._incarnations[wid] = inc
                log.warning("worker %s restarted and rejoined in %.1fs (peers %s)", wid, time.monotonic() - t0, peers)
                self.spawn(self.poll(v))  # healthy at once, not at the next poll
        finally:
            self._rejoining.pop(wid, None)
