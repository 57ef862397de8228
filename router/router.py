"""Router: takes a tokenized request from the gateway to a prefill and a decode worker.

Per request: admission (router.requests.admission) -> placement (router.requests.placement_walk.PlacementWalk: pick a
decode worker D, decide where the prompt is prefilled, `D.reserve` + `P.submit` or
`D.submit_local`) -> tokens flow D -> the request's gateway over the token stream, not through the
router -> `finish` when the gateway is done with it (its blocks count as free at once; with `abort`
every worker that may hold it drops it).

The Router itself keeps the membership: its workers (router.workers.worker_set.WorkerSet), which join and
leave while it serves (`add_worker`, `drain_worker` + `wait_drained`, `remove_worker`: the P:D
planner's role switches), and the requests it admitted (`inflight`). It delegates
- worker health to router.workers.worker_health.WorkerHealth: stats polls (WorkerViews, the KV block index
  of the `prefix_aware` policies), liveness, restarts and rejoins, failing a dead worker's requests;
- migration to router.requests.migrator.Migrator: a request whose worker died is placed again with the
  tokens its client already has (`migrate`, called by the request's gateway).
They share the WorkerSet and the `inflight` table, and call back through the functions they are
given (no part holds the Router).

One Router serves every gateway process: it runs on the launcher's asyncio loop, reached by the
gateways through `RouterServer` (router/channel/server.py), which sets `notify` and `prefilled`; the
launcher sets `rejoin`. Workers are reached through `WorkerClient` (router/workers/worker_client.py: the
typed worker interface of cluster/worker_api.py), which takes a Ray actor handle or (in unit tests)
a plain in-process object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Coroutine, Mapping

from cluster.wire.messages import GenerateRequest
from router.requests.admission import AdmissionController
from router.stats.arrival_stats import ArrivalStats
from router.errors import DrainingError, NotPlacedError
from router.placement.kv_index import KVBlockIndex
from router.stats.metrics import RouterMetrics
from router.requests.migrator import Migrator
from router.placed_request import Notify, PlacedRequest, Prefilled
from router.placement.placement import PlacementPolicies, WorkerView
from router.requests.placement_walk import PlacementWalk
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient
from router.workers.worker_health import GoneCheck, Rejoin, WorkerHealth
from router.workers.worker_set import WorkerSet

# Defined in their own modules; the gateway, the router's channel and the launcher import them from here.
__all__ = ["DrainingError", "PlacedRequest", "Router", "RouterConfig", "WorkerClient"]

log = logging.getLogger(__name__)


class Router:
    def __init__(self, prefill: list[WorkerClient], decode: list[WorkerClient], admission: AdmissionController,
                 cfg: RouterConfig = RouterConfig(), metrics: RouterMetrics | None = None,
                 notify: Notify | None = None, arrivals: ArrivalStats | None = None):
        """arrivals: the request mix it records (the P:D planner reads it; default: a 60 s window)."""
        if not decode:
            raise ValueError("the router needs at least one decode worker")
        self.admission = admission
        self.metrics = metrics
        self.notify: Notify = notify or (lambda rs, error: None)
        self.prefilled: Prefilled = lambda rs: None
        self.rejoin: Rejoin | None = None  # the launcher's; without it a restarted worker serves as it is
        # The launcher's: whether a dead worker is dead for good (Ray will not restart it); without it
        # only the restarts the router counted against worker_max_restarts say so.
        self.gone_check: GoneCheck | None = None
        self.workers = WorkerSet(prefill, decode)
        self.inflight: dict[str, PlacedRequest] = {}
        self._arrivals = arrivals or ArrivalStats()
        self.kv_index = KVBlockIndex()
        self._tasks: set[asyncio.Task] = set()
        policies = PlacementPolicies.create(cfg.prefill_policy, cfg.decode_policy, self.kv_index)
        # notify, prefilled and rejoin are looked up when called: RouterServer.attach and the launcher
        # set them after construction.
        self.health = WorkerHealth(self.workers, cfg, self.kv_index, policies.indexed_roles, self.inflight,
                                   notify=lambda rs, error: self.notify(rs, error), rejoin=self._rejoin,
                                   spawn=self._spawn, polled=self._polled, metrics=metrics,
                                   gone_check=self._gone_check)
        self.walk = PlacementWalk(self.workers, cfg, policies, admission, self.health, self.kv_index, self._arrivals,
                                  self.inflight, notify=lambda rs, error: self.notify(rs, error),
                                  prefilled=lambda rs: self.prefilled(rs), abort_on=self.abort_on, spawn=self._spawn,
                                  metrics=metrics)
        # A request that starts to wait in the admission queue asks for fresh stats (shared by a burst).
        admission.on_queued = lambda: self._spawn(self.refresh(max_wait_s=1.0), name="admission-refresh")
        self.migrator = Migrator(cfg, self.inflight, self.health, self.walk,
                                 forget_placement=lambda rs: self._forget_placement(rs, abort=True), metrics=metrics)
        self.cfg = cfg

    @property
    def cfg(self) -> RouterConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: RouterConfig) -> None:
        """A new config (a test switches migration off for a while) reaches every part at once; the
        policies stay those the router was created with."""
        self._cfg = self.health.cfg = self.walk.cfg = self.migrator.cfg = cfg

    @property
    def arrivals(self) -> ArrivalStats:
        """The request mix: every request asked for (admitted or not) and every finished one."""
        return self._arrivals

    @property
    def draining(self) -> bool:
        """Set on SIGTERM (RouterServer.drain): admission refuses every new request (503)."""
        return self.admission.draining

    @draining.setter
    def draining(self, on: bool) -> None:
        self.admission.draining = on

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.poll_once()
        self.health.start_polling()

    async def stop(self) -> None:
        for rid in list(self.inflight):
            self.finish(rid, abort=True)
        poller = self.health.stop_polling()
        tasks = [t for t in [poller, *self._tasks] if t is not None]
        if tasks:
            # The aborts just sent get a moment; then nothing waits on a worker (or a Ray that no
            # longer answers) any more: the launcher stops the workers next.
            await asyncio.wait(tasks, timeout=1.0)
            for t in tasks:
                t.cancel()

    @property
    def ready(self) -> bool:
        return self.health.polled_once and any(v.healthy for v in self.decode_views())

    def _spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _polled(self) -> None:
        self.admission.pump()  # fresh stats: waiting requests may fit now
        if self.metrics:
            self.metrics.running.set(sum(v.stats.running for v in self.decode_views() if v.healthy))
            self.metrics.waiting.set(self.admission.num_queued)

    async def _rejoin(self, worker_id: str, role: str, peers: list[str]) -> None:
        if self.rejoin is not None:
            await self.rejoin(worker_id, role, peers)

    async def _gone_check(self, worker_id: str) -> bool:
        return self.gone_check is not None and await self.gone_check(worker_id)

    # -- membership -------------------------------------------------------------------------------
    @property
    def views(self) -> Mapping[str, WorkerView]:
        """Every worker's view by id (read-only: membership changes through the methods below)."""
        return self.workers.views

    @property
    def clients(self) -> Mapping[str, WorkerClient]:
        return self.workers.clients

    @property
    def prefill_ids(self) -> list[str]:
        return self.workers.ids("prefill")

    @property
    def decode_ids(self) -> list[str]:
        return self.workers.ids("decode")

    def view(self, worker_id: str) -> WorkerView:
        """The worker's view; KeyError if it is not (or no longer) one of the router's."""
        return self.workers.views[worker_id]

    def prefill_views(self) -> list[WorkerView]:
        return self.workers.of("prefill")

    def decode_views(self) -> list[WorkerView]:
        return self.workers.of("decode")

    async def add_worker(self, client: WorkerClient) -> None:
        """A new worker joins; it is placed on once its first stats poll answers."""
        await self.health.poll(self.workers.add(client))

    def drain_worker(self, worker_id: str) -> None:
        """No new placements on the worker; what it holds runs to the end."""
        self.view(worker_id).draining = True

    async def wait_drained(self, worker_id: str, timeout_s: float) -> int:
        """Waits (up to `timeout_s`) until no request the router placed is left on the worker;
        returns how many still are."""
        v = self.view(worker_id)
        deadline = time.monotonic() + timeout_s
        while v.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(v.inflight)

    def remove_worker(self, worker_id: str) -> None:
        """Takes a (drained) worker out. Requests still on it are failed over like a dead worker's."""
        v = self.view(worker_id)
        if v.role == "decode" and len(self.decode_ids) <= 1:
            raise ValueError("the router needs at least one decode worker")
        if v.inflight:
            self.health.fail_requests_on(v, "was taken out of service")
        self.workers.remove(worker_id)
        self.health.forget(worker_id)
        self.kv_index.drop(worker_id)
        if self.metrics:
            self.metrics.forget_worker(worker_id, v.role)

    # -- health (router.workers.worker_health) --------------------------------------------------------------
    async def poll_once(self) -> None:
        await self.health.poll_once()

    async def refresh(self, max_wait_s: float | None = None) -> None:
        await self.health.refresh(max_wait_s)

    async def alive(self, worker_id: str) -> bool:
        return await self.health.alive(worker_id)

    def incarnation(self, worker_id: str) -> str | None:
        return self.health.incarnation(worker_id)

    # -- requests ---------------------------------------------------------------------------------
    def _admit(self, req: GenerateRequest) -> None:
        wait = self.walk.cost.best_queue_wait_s(self.prefill_views(), self.decode_views())
        self.admission.admit(req.request_id, len(req.prompt_token_ids), req.params.max_tokens, self.decode_views(),
                             wait)

    async def submit(self, req: GenerateRequest) -> PlacedRequest:
        """Admits the request (waiting in the admission queue while it does not fit) and places it;
        returns once a decode worker holds it. Raises InvalidRequestError (400), OverloadedError
        (429) or NoHealthyWorkerError (503). The request's gateway listens for its tokens (at
        `req.reply_to`) before it submits; a cancellation while it waits leaves nothing behind."""
        rid = req.request_id
        self.admission.check_open()
        self._arrivals.record_arrival(len(req.prompt_token_ids), req.params.max_tokens)
        since = time.monotonic()
        again = None  # after a refused placement: when it first queued
        queued = 0.0  # seconds in the admission queue, every turn in it
        while True:
            queued += await self.admission.enter(rid, req.reply_to or "", lambda: self._admit(req), since=again)
            rs = PlacedRequest(req, admitted_time=time.time())
            self.inflight[rid] = rs
            try:
                await self.walk.place(rs)
            except NotPlacedError:
                # Every worker refused although admission saw room: its view was a poll behind them.
                # The request waits for capacity again rather than taking a 429 now (AdmissionController, 6).
                self.finish(rid, abort=True)
                if not self.admission.can_requeue(since, self.cfg.reserve_wait_s):
                    raise
                again = since
                log.info("request %s: no decode worker took it; it waits in the admission queue again", rid)
                continue
            except BaseException:
                # Also on cancellation (client gone while we waited for a reservation): whatever a
                # worker already holds for this request is aborted there.
                self.finish(rid, abort=True)
                raise
            finally:
                self.admission.placed(rid)  # its worker's view counts it now (or it is gone)
            break
        if self.metrics:
            self.metrics.admission_queue_time.observe(queued)
        rs.placed_time = time.time()
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        return rs

    def first_token(self, request_id: str, t: float) -> None:
        """The request's first token reached its gateway: admission counts it as running."""
        rs = self.inflight.get(request_id)
        if rs is not None and rs.first_token_time is None:
            rs.first_token_time = t
            self.admission.mark_running(request_id)

    def finish(self, request_id: str, abort: bool = False, generated: int | None = None) -> None:
        """The gateway is done with the request. With `abort`, every worker that may still hold it
        is told to drop it (its KV blocks go back to the pool). Never blocks; safe to call twice."""
        rs = self.inflight.pop(request_id, None)
        if rs is None:
            return
        if not abort and generated is not None:
            self._arrivals.record_finish(generated)
        self._forget_placement(rs, abort, generated)
        self.admission.release(request_id)  # after the views count its blocks free: a waiting one may fit

    async def migrate(self, request_id: str, worker_request_id: str, generated: tuple[int, ...],
                      emitted_chars: int, failure: str) -> tuple[str, str | None] | None:
        """The request's gateway asks to move it (router.requests.migrator.Migrator.migrate): None when it was
        placed again, else the (finish_reason, error) that ends it."""
        return await self.migrator.migrate(request_id, worker_request_id, generated, emitted_chars, failure)

    def _forget_placement(self, rs: PlacedRequest, abort: bool, generated: int | None = None) -> None:
        """Takes the request off its workers' books (and, with `abort`, off the workers themselves).
        Its KV blocks on the decode worker count as free from now on (WorkerView.release): its
        prompt plus `generated` tokens (its max_tokens when the gateway did not say)."""
        wrid = rs.worker_request_id
        for wid in (rs.decode_worker_id, rs.prefill_worker_id):
            v = self.workers.views.get(wid) if wid is not None else None
            if v is None:
                continue
            v.inflight.discard(rs.request_id)
            if wid == rs.decode_worker_id and v.healthy:
                if wrid in v.placing:  # not in the polled stats yet: nothing to give back either
                    v.forget(wrid)
                else:
                    n = rs.origin.params.max_tokens if generated is None else generated
                    v.release(self.admission.decode_blocks_for(len(rs.origin.prompt_token_ids) + n))
            else:
                v.forget(wrid)
        if abort:
            self.abort_on(rs.decode_worker_id, rs.worker_request_id)
            if rs.prefill_worker_id is not None and not rs.prefill_done:
                self.abort_on(rs.prefill_worker_id, rs.worker_request_id)

    def abort_on(self, worker_id: str | None, request_id: str, error: str | None = None) -> None:
        """Tells the worker, in the background, to drop the request (a gone worker is ignored); with
        `error` (a decode worker), its stream ends with that error instead of an abort."""
        if worker_id is None or worker_id not in self.workers.clients:
            return

        async def abort():
            client = self.workers.clients[worker_id]
            try:
                if error is None:
                    await client.abort(request_id, timeout=self.cfg.call_timeout_s)
                else:
                    await client.fail(request_id, error, timeout=self.cfg.call_timeout_s)
            except Exception as e:  # the worker may be gone; its requests die with it
                log.warning("abort of %s on %s failed: %s", request_id, worker_id, e)
        self._spawn(abort())
