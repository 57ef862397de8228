"""Router: takes a tokenized request from the gateway to a prefill and a decode worker.

Per request: admission -> pick a decode worker D -> decide where the prompt is prefilled
(router.local_prefill_policy: `adaptive` compares the prefill pool's expected wait with the cost of
prefilling on D, router.prefill_cost_model; `static` uses a length threshold) -> remote: `D.reserve`
(blocks for the prompt; None means D is full now, so the next D in the ranking is tried), then
`P.submit` in the background (P computes the prompt, ships its KV into the reserved blocks and
returns timings); local: `D.submit_local` (D prefills it in chunks between its decode steps) ->
tokens flow D -> the request's gateway over the token stream, not through the router. Every prompt
is prefilled locally while no prefill worker is healthy.

The router also polls every worker's `stats()` (admission and placement decide on those, corrected
by the router's own placements and releases since the poll: WorkerView), marks a worker that stops
answering unhealthy and fails the requests placed on it, and aborts a request on every worker that
holds it when the gateway gives up on it (client gone, stop string, error). Workers can join and
leave while it serves (`add_worker`, `drain_worker`, `remove_worker`: the P:D planner's role
switches). With a
`prefix_aware` policy it also polls the workers' block events (`kv_events`) into a `KVBlockIndex` of
who caches which prompt prefix.

Worker death: a request whose decode worker dies is migrated (`migrate_on_worker_death`): the router
tells the request's gateway (`notify`), which stops taking the dead placement's tokens at once and
calls `migrate` with every token the client already got; the request is placed again as prompt +
those tokens, with max_tokens less those and the same seed, under the worker-side id the gateway
chose (`<id>.m<k>`); the stream continues from the next token, so there is no gap and no duplicate,
and greedy or seeded output is what it would have been. A request whose prefill worker dies is placed
again the same way (nothing generated yet).

One Router serves every gateway process: it runs on the launcher's asyncio loop, reached by the
gateways through `RouterServer` (router/router_server.py); workers are reached through
`WorkerClient`, which takes a Ray actor handle or (in unit tests) a plain in-process object.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

from cluster.messages import GenerateRequest, PrefillResult, PrefillTask, Reservation, ReserveRequest, WorkerStats
from router.admission import AdmissionController
from router.arrival_stats import ArrivalStats
from router.errors import CapacityShortError, DrainingError, NoHealthyWorkerError, OverloadedError
from router.kv_index import KVBlockIndex
from router.local_prefill_policy import LOCAL_PREFILL_POLICIES
from router.metrics import RouterMetrics
from router.placement import DECODE_POLICIES, PREFILL_POLICIES, UsesKVIndex, WorkerView
from router.prefill_cost_model import PrefillCostModel

log = logging.getLogger(__name__)

try:  # the router runs without Ray in unit tests; with Ray, a dead actor is recognised at once
    from ray.exceptions import RayActorError as _ActorDead
except ImportError:  # pragma: no cover
    class _ActorDead(Exception):
        pass


async def with_timeout(aw, timeout: float | None):
    """`await aw`, failing with TimeoutError after `timeout` s. Not asyncio.wait_for: on Python 3.11
    it can swallow a cancellation that arrives while its inner future completes (the awaiting task
    then runs on as if never cancelled). asyncio.timeout (3.11+) counts cancellations and has no such
    window."""
    if not timeout:
        return await aw
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover (Python 3.10)


class WorkerClient:
    """Calls a worker method on a Ray actor handle or on a local object, with a timeout."""

    def __init__(self, worker_id: str, role: str, handle):
        self.worker_id = worker_id
        self.role = role
        self.handle = handle

    async def call(self, method: str, *args, timeout: float | None = None):
        fn = getattr(self.handle, method)
        if hasattr(fn, "remote"):
            result = fn.remote(*args)
        else:
            result = fn(*args)
            if not inspect.isawaitable(result):
                return result
        return await with_timeout(result, timeout)


@dataclass(frozen=True)
class RouterConfig:
    prefill_placement: str = "adaptive"  # router.local_prefill_policy: "adaptive" | "static"
    local_prefill_threshold: int = 0  # prompts of at most this many tokens are prefilled on D
    itl_cost_weight: float = 20.0  # TTFT seconds one second of added TPOT is worth (adaptive mode)
    stats_interval_s: float = 0.1
    call_timeout_s: float = 30.0  # reserve / submit_local / stats / abort
    prefill_timeout_s: float = 600.0  # P.submit: queue + prefill + transfer
    reserve_wait_s: float = 2.0  # how long a request may wait for a D with room before a 429
    migration_wait_s: float = 60.0  # how long a migrated request may wait for room (or a restart)
    migrate_on_worker_death: bool = True  # re-place a dead worker's requests (else: an error event)
    workers_restart: bool = False  # Ray restarts dead workers: a migration waits for one to come back
    max_migrations: int = 3  # per request
    unhealthy_after_failures: int = 3  # missed stats polls (a dead Ray actor counts at once)
    prefill_policy: str = "least_outstanding_tokens"
    decode_policy: str = "least_loaded"


@dataclass
class PlacedRequest:
    """The router's record of an admitted request: where it runs and what happened to it.

    `request` is what the workers run (after a migration: prompt + tokens so far, under a new id);
    `origin` is what the client asked for, and `request_id` is always the client's request's id."""

    request: GenerateRequest
    origin: GenerateRequest | None = None
    lost: str | None = None  # set when its worker died: the gateway's next Migrate moves it
    migrations: int = 0
    decode_worker_id: str | None = None
    prefill_worker_id: str | None = None
    local_prefill: bool = False
    prefill_done: bool = False
    cached_tokens: int = 0  # prompt tokens the computing worker found in its prefix cache
    placed_time: float = 0.0
    first_token_time: float | None = None
    prefill_result: PrefillResult | None = None

    def __post_init__(self):
        if self.origin is None:
            self.origin = self.request

    @property
    def request_id(self) -> str:
        return self.origin.request_id

    @property
    def worker_request_id(self) -> str:
        return self.request.request_id


# (request, error message): tells the request's gateway that a worker failed it.
Notify = Callable[[PlacedRequest, str], None]
# Tells the request's gateway that its prompt is computed (`cached_tokens` is final: its usage).
Prefilled = Callable[[PlacedRequest], None]
# (worker id, role, ids of the healthy workers of the other role): makes a restarted worker (a new
# incarnation) ready to serve again: joins its KV transport, warms it up. Raises if it could not.
Rejoin = Callable[[str, str, list[str]], Awaitable[None]]


class Router:
    def __init__(self, prefill: list[WorkerClient], decode: list[WorkerClient], admission: AdmissionController,
                 cfg: RouterConfig = RouterConfig(), metrics: RouterMetrics | None = None,
                 notify: Notify | None = None):
        if not decode:
            raise ValueError("the router needs at least one decode worker")
        self.cfg = cfg
        self.admission = admission
        self.metrics = metrics
        self.notify: Notify = notify or (lambda rs, error: None)
        self.prefilled: Prefilled = lambda rs: None
        self.rejoin: Rejoin | None = None  # the launcher's; without it a restarted worker serves as it is
        self.draining = False  # set on SIGTERM: new requests are refused (503)
        self.clients = {c.worker_id: c for c in [*prefill, *decode]}
        if len(self.clients) != len(prefill) + len(decode):
            raise ValueError("worker ids must be unique")
        self.views = {c.worker_id: WorkerView(c.worker_id, c.role, WorkerStats(c.worker_id, c.role, healthy=False))
                      for c in self.clients.values()}
        self.prefill_ids = [c.worker_id for c in prefill]
        self.decode_ids = [c.worker_id for c in decode]
        self.prefill_policy = PREFILL_POLICIES.create(cfg.prefill_policy)
        self.decode_policy = DECODE_POLICIES.create(cfg.decode_policy)
        self.prefill_choice = LOCAL_PREFILL_POLICIES.create(cfg.prefill_placement, threshold=cfg.local_prefill_threshold)
        self.cost = PrefillCostModel(cfg.itl_cost_weight)
        self.arrivals = ArrivalStats()
        self.kv_index = KVBlockIndex()
        self._indexed_roles = set()  # roles whose cached blocks a policy ranks by
        for role, policy in (("prefill", self.prefill_policy), ("decode", self.decode_policy)):
            if isinstance(policy, UsesKVIndex):
                policy.bind_kv_index(self.kv_index)
                self._indexed_roles.add(role)
        self.inflight: dict[str, PlacedRequest] = {}
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._polled_once = False
        self._refreshing: asyncio.Future | None = None
        self._fresh_as_of = -1e9  # when the last completed poll of every worker was issued
        # Restarts: a worker's stats carry the incarnation of its process (extra["incarnation"], new on
        # every Ray restart of its actor); a new one is kept unhealthy until it rejoined.
        self._incarnations: dict[str, str] = {}  # worker id -> the incarnation it serves as
        self._rejoining: dict[str, asyncio.Task] = {}
        self._rejoin_after: dict[str, float] = {}  # worker id -> when a failed rejoin may be retried

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop(), name="router-stats")

    async def stop(self) -> None:
        for rid in list(self.inflight):
            self.finish(rid, abort=True)
        if self._poller is not None:
            self._poller.cancel()
        tasks = [t for t in [self._poller, *self._tasks] if t is not None]
        if tasks:
            # The aborts just sent get a moment; then nothing waits on a worker (or a Ray that no
            # longer answers) any more: the launcher stops the workers next.
            await asyncio.wait(tasks, timeout=1.0)
            for t in tasks:
                t.cancel()
        self._poller = None

    @property
    def ready(self) -> bool:
        return self._polled_once and any(self.views[w].healthy for w in self.decode_ids)

    def decode_views(self) -> list[WorkerView]:
        return [self.views[w] for w in self.decode_ids]

    def prefill_views(self) -> list[WorkerView]:
        return [self.views[w] for w in self.prefill_ids]

    # -- membership (the P:D planner's role switches) ----------------------------------------------
    async def add_worker(self, client: WorkerClient) -> None:
        """A new worker joins; it is placed on once its first stats poll answers."""
        if client.worker_id in self.clients:
            raise ValueError(f"worker id {client.worker_id!r} is already in use")
        self.clients[client.worker_id] = client
        v = WorkerView(client.worker_id, client.role, WorkerStats(client.worker_id, client.role, healthy=False))
        self.views[client.worker_id] = v
        (self.prefill_ids if client.role == "prefill" else self.decode_ids).append(client.worker_id)
        await self._poll(v)

    def drain_worker(self, worker_id: str) -> None:
        """No new placements on the worker; what it holds runs to the end."""
        self.views[worker_id].draining = True

    def remove_worker(self, worker_id: str) -> None:
        """Takes a (drained) worker out. Requests still on it are failed over like a dead worker's."""
        v = self.views[worker_id]
        if v.role == "decode" and len(self.decode_ids) <= 1:
            raise ValueError("the router needs at least one decode worker")
        if v.inflight:
            self._fail_requests_on(v, "was taken out of service")
        (self.prefill_ids if v.role == "prefill" else self.decode_ids).remove(worker_id)
        del self.views[worker_id]
        del self.clients[worker_id]
        self._incarnations.pop(worker_id, None)
        self.kv_index.drop(worker_id)
        if self.metrics:
            self.metrics.forget_worker(worker_id, v.role)

    # -- requests ---------------------------------------------------------------------------------
    def _admit(self, req: GenerateRequest) -> None:
        wait = self.cost.best_queue_wait_s(self.prefill_views(), self.decode_views())
        self.admission.admit(req.request_id, len(req.prompt_token_ids), req.params.max_tokens, self.decode_views(),
                             wait, self._cached_blocks(req))

    def _cached_blocks(self, req: GenerateRequest) -> dict[str, int]:
        """The prompt's leading blocks each decode worker reported caching (empty when no policy
        keeps the index): a worker holding them needs only the rest of the prompt's blocks free,
        as its reservation pins the cached ones. Stale entries only cost a refused reservation."""
        if "decode" not in self._indexed_roles or self.kv_index.block_size is None:
            return {}
        return self.kv_index.overlap(self.kv_index.hashes(req.prompt_token_ids), self.decode_ids)

    async def submit(self, req: GenerateRequest) -> PlacedRequest:
        """Admits and places the request; returns once a decode worker holds it. Raises
        InvalidRequestError (400), OverloadedError (429) or NoHealthyWorkerError (503). The request's
        gateway listens for its tokens (at `req.reply_to`) before it submits."""
        rid = req.request_id
        if self.draining:
            raise DrainingError("the server is shutting down; retry on another replica")
        self.arrivals.record_arrival(len(req.prompt_token_ids), req.params.max_tokens)
        try:
            self._admit(req)
        except CapacityShortError:
            # Decided on polled state: ask the workers again before refusing (an idle server whose
            # last poll predates a finish must not answer 429). Bounded: under real overload the
            # workers answer slowly, and a 429 must still come at once.
            await self.refresh(max_wait_s=max(0.05, min(0.25, 2 * self.cfg.stats_interval_s)))
            self._admit(req)
        rs = PlacedRequest(req)
        self.inflight[rid] = rs
        try:
            await self._place(rs)
        except BaseException:
            # Also on cancellation (client gone while we waited for a reservation): whatever a
            # worker already holds for this request is aborted there.
            self.finish(rid, abort=True)
            raise
        rs.placed_time = time.time()
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        return rs

    async def _place(self, rs: PlacedRequest, wait_s: float | None = None, wait_for_restart: bool = False) -> None:
        """Places the request, waiting up to `wait_s` (default reserve_wait_s) for a decode worker with
        room. A migration waits longer (migration_wait_s): the request was admitted, its client is
        still reading, and the blocks it needs may be held by the dead worker's transfers a moment more.
        With `wait_for_restart` it also waits while no decode worker is healthy (one is restarting)."""
        req = rs.request
        prompt_len = len(req.prompt_token_ids)
        need = self.admission.blocks_for(prompt_len + 1)
        cached = self._cached_blocks(req)
        wait_s = self.cfg.reserve_wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        mean_output = self.arrivals.mix().mean_output_tokens or req.params.max_tokens
        while True:
            prefill_ranked = self.prefill_policy.rank(self.prefill_views(), req)
            for d in self.decode_policy.rank(self.decode_views(), req, need):
                choice = self.prefill_choice.choose(prompt_len, d, prefill_ranked, self.cost, mean_output)
                rs.decode_worker_id = d.worker_id
                new_blocks = need - cached.get(d.worker_id, 0)
                if choice.local:
                    ok = await self._try_local(rs, d, new_blocks)
                else:
                    ok = await self._try_disaggregated(rs, d, choice.prefill, new_blocks)
                if ok:
                    if self.metrics:
                        self.metrics.prefill_placed("local" if choice.local else "remote", choice.reason)
                    return
            rs.decode_worker_id = None
            if not wait_for_restart and not any(v.healthy for v in self.decode_views()):
                raise NoHealthyWorkerError("no healthy decode worker is available")
            if time.monotonic() >= deadline:
                raise OverloadedError(f"no decode worker could take the request within {wait_s:g}s; "
                                      "retry later", self.admission.limits.retry_after_s)
            await asyncio.sleep(self.cfg.stats_interval_s)

    # The placement is counted on the workers' views from the moment it is decided (WorkerView.begin),
    # before the call goes out: concurrent placements awaiting their calls see each other.
    async def _try_local(self, rs: PlacedRequest, d: WorkerView, need: int) -> bool:
        wrid = rs.worker_request_id
        d.begin(wrid, need, len(rs.request.prompt_token_ids))
        try:
            cached = await self.clients[d.worker_id].call("submit_local", rs.request, timeout=self.cfg.call_timeout_s)
        except Exception as e:
            d.rollback(wrid)
            self._call_failed(d, e)
            return False
        except BaseException:
            d.rollback(wrid)
            raise
        if cached is None:
            d.rollback(wrid)
            self._refused(d)
            return False
        d.ack(wrid)
        rs.local_prefill = rs.prefill_done = True
        rs.cached_tokens = cached
        self._placed(rs, d)
        self.prefilled(rs)
        if self.metrics:
            self.metrics.local_prefills.inc()
        return True

    async def _try_disaggregated(self, rs: PlacedRequest, d: WorkerView, p: WorkerView, need: int) -> bool:
        wrid = rs.worker_request_id
        d.begin(wrid, need, 0)
        p.begin(wrid, 0, len(rs.request.prompt_token_ids))
        call = asyncio.ensure_future(self.clients[d.worker_id].call(
            "reserve", ReserveRequest(rs.request, p.worker_id), timeout=self.cfg.call_timeout_s))
        try:
            res: Reservation | None = await asyncio.shield(call)
        except BaseException as e:
            d.rollback(wrid)
            p.rollback(wrid)
            if isinstance(e, Exception):
                self._call_failed(d, e)
                return False
            # NOTE: cancelled (the client left) while D reserved. Once D has reserved, P must hear of
            # it: D's receiver takes a pair's transfers in transfer_seq order, so a reservation P is
            # never told about would hold up every later transfer from P to D (until D's expect
            # timeout). The reservation finishes in the background and is handed to P, aborted.
            call.add_done_callback(lambda f: self._hand_off_orphan(f, rs, p))
            raise
        if res is None:
            d.rollback(wrid)
            p.rollback(wrid)
            self._refused(d)
            return False
        d.ack(wrid, len(res.block_ids))
        self._placed(rs, d)
        rs.prefill_worker_id = p.worker_id
        p.inflight.add(rs.request_id)
        p.placed_total += 1
        self._spawn(self._run_prefill(rs, p, PrefillTask(rs.request, res)))
        return True

    def _hand_off_orphan(self, call: asyncio.Future, rs: PlacedRequest, p: WorkerView) -> None:
        """A reservation made for a request that was given up meanwhile: P gets the task and its abort
        right after (Ray starts one caller's calls in order), so P tells D there is no KV."""
        if call.cancelled() or call.exception() is not None or call.result() is None:
            return
        res: Reservation = call.result()
        self._spawn(self._run_prefill(rs, p, PrefillTask(rs.request, res)))
        self._abort_on(p.worker_id, res.request_id)

    def _placed(self, rs: PlacedRequest, d: WorkerView) -> None:
        d.placed_total += 1
        d.inflight.add(rs.request_id)

    def _refused(self, d: WorkerView) -> None:
        # D is full right now: not ranked again until a fresh poll says otherwise (asked at once).
        d.refused = True
        self._spawn(self._poll(d))
        if self.metrics:
            self.metrics.reserve_retries.inc()

    async def _run_prefill(self, rs: PlacedRequest, p: WorkerView, task: PrefillTask) -> None:
        rid, wrid = rs.request_id, rs.worker_request_id
        error = None
        try:
            # NOTE: acked when the call goes out, not when it returns (after prefill + transfer): Ray
            # starts an actor's calls from one caller in order, so any stats poll issued after this
            # line already sees the prompt in P's queue. No await between ack and the call.
            p.ack(wrid)
            result: PrefillResult = await self.clients[p.worker_id].call("submit", task, timeout=self.cfg.prefill_timeout_s)
            rs.prefill_result = result
            if not result.ok:
                error = result.error or "prefill failed"
            elif result.transfer_s > 0:
                self.cost.observe_transfer(len(task.request.prompt_token_ids), result.transfer_s)
            if result.ok and self.metrics:
                self.metrics.queue.observe(result.queue_s)
                self.metrics.prefill.observe(result.prefill_s)
                self.metrics.kv_transfer.observe(result.transfer_s)
                self.metrics.kv_transfer_size.observe(result.transfer_bytes)
                self.metrics.kv_transfer_bytes.inc(result.transfer_bytes)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = f"prefill worker {p.worker_id} failed: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._call_failed(p, e)
        finally:
            p.forget(wrid)
            current = rs.worker_request_id == wrid  # not migrated meanwhile
            if current:
                rs.prefill_done = True
                p.inflight.discard(rid)
                if error is None:
                    rs.cached_tokens = result.cached_tokens
                    self.prefilled(rs)
        if error is not None and current and rid in self.inflight and rs.lost is None:
            log.warning("request %s: %s", rid, error)
            self.notify(rs, error)
            self._abort_on(rs.decode_worker_id, wrid)

    def finish(self, request_id: str, abort: bool = False, generated: int | None = None) -> None:
        """The gateway is done with the request. With `abort`, every worker that may still hold it
        is told to drop it (its KV blocks go back to the pool). Never blocks; safe to call twice."""
        rs = self.inflight.pop(request_id, None)
        if rs is None:
            return
        self.admission.release(request_id)
        if not abort and generated is not None:
            self.arrivals.record_finish(generated)
        self._forget_placement(rs, abort, generated)

    def first_token(self, request_id: str, t: float) -> None:
        """The request's first token reached its gateway: admission counts it as running."""
        rs = self.inflight.get(request_id)
        if rs is not None and rs.first_token_time is None:
            rs.first_token_time = t
            self.admission.mark_running(request_id)

    def _forget_placement(self, rs: PlacedRequest, abort: bool, generated: int | None = None) -> None:
        """Takes the request off its workers' books (and, with `abort`, off the workers themselves).
        Its KV blocks on the decode worker count as free from now on (WorkerView.release): its
        prompt plus `generated` tokens (its max_tokens when the gateway did not say)."""
        wrid = rs.worker_request_id
        for wid in (rs.decode_worker_id, rs.prefill_worker_id):
            v = self.views.get(wid) if wid is not None else None
            if v is None:
                continue
            v.inflight.discard(rs.request_id)
            if wid == rs.decode_worker_id and v.healthy:
                if wrid in v.placing:  # not in the polled stats yet: nothing to give back either
                    v.forget(wrid)
                else:
                    n = rs.origin.params.max_tokens if generated is None else generated
                    v.release(self.admission.blocks_for(len(rs.origin.prompt_token_ids) + n + 1))
            else:
                v.forget(wrid)
        if abort:
            self._abort_on(rs.decode_worker_id, rs.worker_request_id)
            if rs.prefill_worker_id is not None and not rs.prefill_done:
                self._abort_on(rs.prefill_worker_id, rs.worker_request_id)

    async def migrate(self, request_id: str, worker_request_id: str, generated: tuple[int, ...],
                      emitted_chars: int, failure: str) -> tuple[str, str | None] | None:
        """A worker failed the request after the client got `generated` (and `emitted_chars`
        characters of their text). If that worker died, places the request again as prompt +
        `generated` under `worker_request_id` and returns None (its tokens follow to the same gateway);
        otherwise returns the (finish_reason, error) that ends it."""
        rs = self.inflight.get(request_id)
        if rs is None:
            return "error", failure
        if (rs.lost is None and not generated and rs.prefill_worker_id is not None
                and not await self.alive(rs.prefill_worker_id)):
            # The decode side may see a transfer break (and fail the request) before the router has
            # noticed that the prefill worker died: nothing was streamed yet, so run it elsewhere.
            rs.lost = f"prefill worker {rs.prefill_worker_id} died"
        if rs.lost is None and rs.decode_worker_id is not None and await self._lost_on(rs.decode_worker_id,
                                                                                        worker_request_id=rs.worker_request_id):
            # Its decode worker failed it for a failure of its own (a loop exception, the process
            # alive): moved like a dead worker's request.
            rs.lost = failure
        if rs.lost is None or not self.cfg.migrate_on_worker_death:
            return "error", failure
        why, rs.lost = rs.lost, None
        origin = rs.origin
        done = len(generated)
        left = origin.params.max_tokens - done
        if left <= 0:
            return "length", None
        if rs.migrations >= self.cfg.max_migrations:
            return "error", f"{why}; not migrated again after {rs.migrations} moves"
        self._forget_placement(rs, abort=True)  # whatever is left of it on a live worker
        rs.migrations += 1
        p = origin.params
        rs.request = replace(
            origin, request_id=worker_request_id, prompt_token_ids=origin.prompt_token_ids + tuple(generated),
            params=replace(p, max_tokens=left, min_tokens=max(0, p.min_tokens - done)),
            resumed_tokens=done, resumed_chars=emitted_chars)
        rs.decode_worker_id = rs.prefill_worker_id = None
        rs.local_prefill = rs.prefill_done = False
        log.warning("request %s: %s; migrating with %d tokens so far as %s", rs.request_id, why, done,
                    rs.worker_request_id)
        try:
            await self._place(rs, self.cfg.migration_wait_s, wait_for_restart=self.cfg.workers_restart)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return "error", f"{why}; migration failed: {e}"
        if self.metrics:
            self.metrics.migrations.inc()
        return None

    def _abort_on(self, worker_id: str | None, request_id: str) -> None:
        if worker_id is None or worker_id not in self.clients:
            return

        async def abort():
            try:
                await self.clients[worker_id].call("abort", request_id, timeout=self.cfg.call_timeout_s)
            except Exception as e:  # the worker may be gone; its requests die with it
                log.warning("abort of %s on %s failed: %s", request_id, worker_id, e)
        self._spawn(abort())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- health -----------------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.stats_interval_s)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("stats poll failed")

    async def poll_once(self) -> None:
        issued = time.monotonic()
        await asyncio.gather(*(self._poll(v) for v in list(self.views.values())))
        self._fresh_as_of = max(self._fresh_as_of, issued)
        self._polled_once = True
        if self.metrics:
            self.metrics.running.set(sum(v.stats.running for v in self.decode_views() if v.healthy))
            self.metrics.waiting.set(self.admission.num_waiting)

    async def refresh(self, max_wait_s: float | None = None) -> None:
        """Polls every worker now, unless a poll went out a moment ago; concurrent callers share
        one poll (a burst of refusals does not become a burst of polls). Returns after at most
        `max_wait_s` even if the poll has not answered yet (it goes on and updates the views)."""
        if self._refreshing is None:
            if time.monotonic() - self._fresh_as_of < min(0.02, self.cfg.stats_interval_s / 4):
                return
            self._refreshing = fut = asyncio.ensure_future(self.poll_once())

            def done(_):
                if self._refreshing is fut:
                    self._refreshing = None
            fut.add_done_callback(done)
        # asyncio.wait neither cancels the shared poll nor swallows our own cancellation.
        await asyncio.wait({self._refreshing}, timeout=max_wait_s)

    async def _poll(self, v: WorkerView) -> None:
        client = self.clients.get(v.worker_id)
        if client is None:  # removed meanwhile
            return
        issued = time.monotonic()
        try:
            stats = await client.call("stats", timeout=max(1.0, min(self.cfg.call_timeout_s, 10.0)))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._call_failed(v, e)
        else:
            was_healthy = v.healthy
            v.update(stats, issued)
            if self._restarted(v, stats, was_healthy):
                v.healthy = False  # until it rejoined
            elif was_healthy and not v.healthy:
                self.kv_index.drop(v.worker_id)
                self._fail_requests_on(v, "reported itself unhealthy")
            if v.healthy and v.role in self._indexed_roles:
                await self._poll_kv_events(v)
        if self.metrics and v.worker_id in self.views:
            self.metrics.observe_worker(v.stats, v.worker_id, v.role, v.healthy)

    async def _poll_kv_events(self, v: WorkerView) -> None:
        """Brings the index up to date with the worker's cached blocks. The index only ranks workers,
        so a failed poll just leaves it a poll behind (health is the stats poll's business)."""
        try:
            ev = await self.clients[v.worker_id].call("kv_events", *self.kv_index.position(v.worker_id),
                                                      timeout=max(1.0, min(self.cfg.call_timeout_s, 10.0)))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("kv_events of %s failed: %s", v.worker_id, e)
        else:
            self.kv_index.apply(ev)

    async def alive(self, worker_id: str) -> bool:
        """Asks the worker now (a dead Ray actor answers at once with an error)."""
        v = self.views.get(worker_id)
        if v is None:  # taken out of service
            return False
        if v.healthy:
            try:
                await self.clients[worker_id].call("stats", timeout=max(1.0, min(self.cfg.call_timeout_s, 5.0)))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._call_failed(v, e)
                return not isinstance(e, _ActorDead)
        return v.healthy

    async def _lost_on(self, worker_id: str, worker_request_id: str) -> bool:
        """Whether the worker dropped the request through a failure of its own (or is dead)."""
        if worker_id not in self.clients:
            return False
        try:
            return bool(await self.clients[worker_id].call("lost", worker_request_id,
                                                            timeout=max(1.0, min(self.cfg.call_timeout_s, 5.0))))
        except asyncio.CancelledError:
            raise
        except _ActorDead as e:
            self._call_failed(self.views[worker_id], e)
            return True
        except Exception:  # noqa: BLE001 - a worker without the method (test doubles), or not answering
            return False

    def _call_failed(self, v: WorkerView, e: BaseException) -> None:
        v.consecutive_failures += 1
        dead = isinstance(e, _ActorDead)  # also while Ray restarts it (ActorUnavailableError)
        if v.healthy and (dead or v.consecutive_failures >= self.cfg.unhealthy_after_failures):
            log.error("worker %s is unhealthy: %s: %s", v.worker_id, e.__class__.__name__, e)
            self._worker_failed(v, dead, f"Ray reports worker {v.worker_id} dead")

    def _worker_failed(self, v: WorkerView, dead: bool, why: str) -> None:
        v.healthy = False
        self.kv_index.drop(v.worker_id)
        if dead:
            self._tell_peers(v, why)
        self._fail_requests_on(v, "died" if dead else "stopped answering")

    # -- restarts -----------------------------------------------------------------------------------
    def incarnation(self, worker_id: str) -> str | None:
        """The process incarnation the worker serves as: changes once a restarted worker rejoined."""
        return self._incarnations.get(worker_id)

    def _restarted(self, v: WorkerView, stats: WorkerStats, was_healthy: bool) -> bool:
        """Whether the worker answering is a new incarnation that has not rejoined yet (Ray restarted
        its actor: no KV transport, cold). Starts its rejoin; once that succeeded, the next poll
        marks it healthy and the router places on it again. A restart the router never saw fail (it
        happened between two polls) is a death first: what the old incarnation held is gone."""
        wid, inc = v.worker_id, stats.extra.get("incarnation")
        known = self._incarnations.setdefault(wid, inc)
        if inc == known:
            return False
        if was_healthy:
            log.error("worker %s restarted (incarnation %s) between two polls", wid, inc)
            self._worker_failed(v, True, f"worker {wid} restarted")
        if wid not in self._rejoining and time.monotonic() >= self._rejoin_after.get(wid, 0.0):
            log.warning("worker %s answers as a new incarnation (%s): rejoining it", wid, inc)
            task = asyncio.get_running_loop().create_task(self._rejoin(v, inc), name=f"rejoin-{wid}")
            self._rejoining[wid] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def _rejoin(self, v: WorkerView, inc: str) -> None:
        wid = v.worker_id
        other = self.decode_ids if v.role == "prefill" else self.prefill_ids
        peers = [w for w in other if self.views[w].healthy]
        t0 = time.monotonic()
        try:
            if self.rejoin is not None:
                await self.rejoin(wid, v.role, peers)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - retried a moment later, from a poll
            log.error("worker %s restarted but did not rejoin: %s: %s", wid, e.__class__.__name__, e)
            self._rejoin_after[wid] = time.monotonic() + 1.0
        else:
            if self.clients.get(wid) is not None:
                self._incarnations[wid] = inc
                log.warning("worker %s restarted and rejoined in %.1fs (peers %s)", wid, time.monotonic() - t0, peers)
                self._spawn(self._poll(v))  # healthy at once, not at the next poll
        finally:
            self._rejoining.pop(wid, None)

    def _tell_peers(self, v: WorkerView, why: str) -> None:
        """A worker died: every worker of the other role drops its KV transfers with it now (a decode
        worker frees the blocks it reserved for them), instead of after its transport's heartbeat
        timeout. Before the requests are moved, so their new placements find the blocks free."""
        other = self.decode_ids if v.role == "prefill" else self.prefill_ids
        for wid in other:
            if self.views[wid].healthy:
                client = self.clients[wid]

                async def tell(client=client):
                    try:
                        await client.call("peer_died", v.worker_id, why, timeout=self.cfg.call_timeout_s)
                    except Exception as e:  # noqa: BLE001 - its own heartbeat check still finds out
                        log.warning("telling %s that %s died failed: %s", client.worker_id, v.worker_id, e)
                self._spawn(tell())

    def _fail_requests_on(self, v: WorkerView, why: str) -> None:
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
