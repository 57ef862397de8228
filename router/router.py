"""Router: takes a tokenized request from the gateway to a prefill and a decode worker.

Per request: admission -> pick a prefill worker P and a decode worker D -> `D.reserve` (blocks for
the prompt; None means D is full now, so the next D in the ranking is tried) -> `P.submit` in the
background (P computes the prompt, ships its KV into the reserved blocks and returns timings) ->
tokens flow D -> gateway over the token stream, not through the router. Prompts at or below
`local_prefill_threshold` tokens skip P: `D.submit_local` prefills them on D itself, which is cheaper
than a transfer (conditional disaggregation); so does every prompt while no prefill worker is healthy.

The router also polls every worker's `stats()` (admission and placement decide on those), marks a
worker that stops answering unhealthy and fails the requests placed on it, and aborts a request on
every worker that holds it when the gateway gives up on it (client gone, stop string, error).

Worker death: a request whose decode worker dies is migrated (`migrate_on_worker_death`): when the
gateway reads the failure, the request is placed again, as prompt + every token the client already
got, with max_tokens less those and the same seed, under a new worker-side id (`<id>.m<k>`); the
stream continues from the next token, so there is no gap and no duplicate, and greedy or seeded output
is what it would have been. A request whose prefill worker dies is placed again the same way (nothing
generated yet). The dead worker's late token frames are dropped: its worker-side id is unregistered
from the token stream the moment the worker is found dead.

Everything runs on the gateway's asyncio loop; workers are reached through `WorkerClient`, which
takes a Ray actor handle or (in unit tests) a plain in-process object.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field, replace

from cluster.messages import GenerateRequest, PrefillResult, PrefillTask, Reservation, ReserveRequest, TokenDelta, WorkerStats
from router.admission import AdmissionController, NoHealthyWorkerError, OverloadedError
from router.metrics import ServingMetrics
from router.placement import DECODE_POLICIES, PREFILL_POLICIES, WorkerView
from router.token_stream import TokenStreamReceiver

log = logging.getLogger(__name__)

try:  # the router runs without Ray in unit tests; with Ray, a dead actor is recognised at once
    from ray.exceptions import RayActorError as _ActorDead
except ImportError:  # pragma: no cover
    class _ActorDead(Exception):
        pass


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
        return await asyncio.wait_for(result, timeout) if timeout else await result


@dataclass(frozen=True)
class RouterConfig:
    local_prefill_threshold: int = 0  # prompts of at most this many tokens are prefilled on D
    stats_interval_s: float = 0.1
    call_timeout_s: float = 30.0  # reserve / submit_local / stats / abort
    prefill_timeout_s: float = 600.0  # P.submit: queue + prefill + transfer
    reserve_wait_s: float = 2.0  # how long a request may wait for a D with room before a 429
    migrate_on_worker_death: bool = True  # re-place a dead worker's requests (else: an error event)
    max_migrations: int = 3  # per request
    unhealthy_after_failures: int = 3  # missed stats polls (a dead Ray actor counts at once)
    prefill_policy: str = "least_outstanding_tokens"
    decode_policy: str = "least_loaded"


@dataclass
class RequestStream:
    """The gateway's handle on a placed request: its token deltas and where it runs.

    `request` is what the workers run (after a migration: prompt + tokens so far, under a new id);
    `origin` is what the client asked for, and `request_id` is always the client's request's id."""

    request: GenerateRequest
    queue: asyncio.Queue
    origin: GenerateRequest | None = None
    generated: list[int] = field(default_factory=list)  # token ids the gateway has read so far
    lost: str | None = None  # set when its worker died: the next read migrates the request
    migrations: int = 0
    decode_worker_id: str | None = None
    prefill_worker_id: str | None = None
    local_prefill: bool = False
    prefill_done: bool = False
    placed_time: float = 0.0
    first_token_time: float | None = None
    prefill_result: PrefillResult | None = None
    _router: "Router | None" = field(default=None, repr=False)

    def __post_init__(self):
        if self.origin is None:
            self.origin = self.request

    @property
    def request_id(self) -> str:
        return self.origin.request_id

    @property
    def worker_request_id(self) -> str:
        return self.request.request_id

    async def get(self, timeout: float | None = None) -> TokenDelta:
        """The next delta, merged with any others already queued: a gateway that falls behind the
        decode steps sends one chunk with several tokens instead of a backlog of single ones."""
        delta = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
        while not self.queue.empty() and delta.finish_reason is None and delta.error is None:
            nxt = self.queue.get_nowait()
            delta = TokenDelta(delta.request_id, delta.token_ids + nxt.token_ids, nxt.finish_reason, nxt.error)
        self.generated.extend(delta.token_ids)
        if (delta.finish_reason == "error" and self.lost is None and not self.generated and self._router is not None
                and self.prefill_worker_id is not None and not await self._router.alive(self.prefill_worker_id)):
            # The decode side may see a transfer break (and fail the request) before the router has
            # noticed that the prefill worker died: nothing was streamed yet, so run it elsewhere.
            self.lost = f"prefill worker {self.prefill_worker_id} died"
        if self.lost is not None and delta.finish_reason == "error" and self._router is not None:
            # Our worker died: every token before this delta was read, so the request resumes from
            # exactly here on a healthy worker; the tokens read with the failure still go out.
            end = await self._router.migrate(self, delta)
            delta = TokenDelta(delta.request_id, delta.token_ids, end.finish_reason if end else None,
                               end.error if end else None)
            if not delta.token_ids and end is None:
                return await self.get(timeout)
        if self.first_token_time is None and delta.token_ids:
            self.first_token_time = time.time()
            if self._router is not None:
                self._router.admission.mark_running(self.request_id)
        return delta


class Router:
    def __init__(self, prefill: list[WorkerClient], decode: list[WorkerClient], token_stream: TokenStreamReceiver,
                 admission: AdmissionController, cfg: RouterConfig = RouterConfig(),
                 metrics: ServingMetrics | None = None):
        if not decode:
            raise ValueError("the router needs at least one decode worker")
        self.cfg = cfg
        self.admission = admission
        self.token_stream = token_stream
        self.metrics = metrics
        self.clients = {c.worker_id: c for c in [*prefill, *decode]}
        if len(self.clients) != len(prefill) + len(decode):
            raise ValueError("worker ids must be unique")
        self.views = {c.worker_id: WorkerView(c.worker_id, c.role, WorkerStats(c.worker_id, c.role, healthy=False))
                      for c in self.clients.values()}
        self.prefill_ids = [c.worker_id for c in prefill]
        self.decode_ids = [c.worker_id for c in decode]
        self.prefill_policy = PREFILL_POLICIES.create(cfg.prefill_policy)
        self.decode_policy = DECODE_POLICIES.create(cfg.decode_policy)
        self.inflight: dict[str, RequestStream] = {}
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._polled_once = False

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
            await asyncio.wait(tasks, timeout=5.0)
        self._poller = None

    @property
    def ready(self) -> bool:
        return self._polled_once and any(self.views[w].healthy for w in self.decode_ids)

    def decode_views(self) -> list[WorkerView]:
        return [self.views[w] for w in self.decode_ids]

    def prefill_views(self) -> list[WorkerView]:
        return [self.views[w] for w in self.prefill_ids]

    # -- requests ---------------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> RequestStream:
        """Admits and places the request; returns once a decode worker holds it. Raises
        InvalidRequestError (400), OverloadedError (429) or NoHealthyWorkerError (503)."""
        rid = req.request_id
        self.admission.admit(rid, len(req.prompt_token_ids), req.params.max_tokens, self.decode_views())
        rs = RequestStream(req, self.token_stream.register(rid), _router=self)
        self.inflight[rid] = rs
        try:
            await self._place(rs)
        except BaseException:
            # Also on cancellation (client gone while we waited for a reservation): whatever a
            # worker already holds for this request is aborted there.
            self.finish(rid, abort=True)
            raise
        rs.placed_time = time.time()
        return rs

    async def _place(self, rs: RequestStream) -> None:
        req = rs.request
        prompt_len = len(req.prompt_token_ids)
        need = self.admission.blocks_for(prompt_len + 1)
        deadline = time.monotonic() + self.cfg.reserve_wait_s
        while True:
            prefill_ranked = self.prefill_policy.rank(self.prefill_views(), req)
            local = prompt_len <= self.cfg.local_prefill_threshold or not prefill_ranked
            for d in self.decode_policy.rank(self.decode_views(), req, need):
                rs.decode_worker_id = d.worker_id
                if local:
                    if await self._try_local(rs, d, need):
                        return
                elif await self._try_disaggregated(rs, d, prefill_ranked[0], need):
                    return
            rs.decode_worker_id = None
            if not any(v.healthy for v in self.decode_views()):
                raise NoHealthyWorkerError("no healthy decode worker is available")
            if time.monotonic() >= deadline:
                raise OverloadedError(f"no decode worker could take the request within {self.cfg.reserve_wait_s:g}s; "
                                      "retry later", self.admission.limits.retry_after_s)
            await asyncio.sleep(self.cfg.stats_interval_s)

    async def _try_local(self, rs: RequestStream, d: WorkerView, need: int) -> bool:
        try:
            ok = await self.clients[d.worker_id].call("submit_local", rs.request, timeout=self.cfg.call_timeout_s)
        except Exception as e:
            self._call_failed(d, e)
            return False
        if not ok:
            self._refused(d)
            return False
        rs.local_prefill = rs.prefill_done = True
        self._placed(rs, d, need)
        if self.metrics:
            self.metrics.local_prefills.inc()
        return True

    async def _try_disaggregated(self, rs: RequestStream, d: WorkerView, p: WorkerView, need: int) -> bool:
        try:
            res: Reservation | None = await self.clients[d.worker_id].call(
                "reserve", ReserveRequest(rs.request, p.worker_id), timeout=self.cfg.call_timeout_s)
        except Exception as e:
            self._call_failed(d, e)
            return False
        if res is None:
            self._refused(d)
            return False
        self._placed(rs, d, len(res.block_ids))
        rs.prefill_worker_id = p.worker_id
        p.inflight.add(rs.request_id)
        p.placed_total += 1
        p.pending_prefill_tokens += len(rs.request.prompt_token_ids)
        self._spawn(self._run_prefill(rs, p, PrefillTask(rs.request, res)))
        return True

    def _placed(self, rs: RequestStream, d: WorkerView, blocks: int) -> None:
        d.pending_blocks += blocks
        d.pending_running += 1
        d.placed_total += 1
        d.inflight.add(rs.request_id)

    def _refused(self, d: WorkerView) -> None:
        # D is full right now: treat it as full until its next stats poll.
        d.pending_blocks = d.stats.free_blocks
        if self.metrics:
            self.metrics.reserve_retries.inc()

    async def _run_prefill(self, rs: RequestStream, p: WorkerView, task: PrefillTask) -> None:
        rid, wrid = rs.request_id, rs.worker_request_id
        error = None
        try:
            result: PrefillResult = await self.clients[p.worker_id].call("submit", task, timeout=self.cfg.prefill_timeout_s)
            rs.prefill_result = result
            if not result.ok:
                error = result.error or "prefill failed"
            elif self.metrics:
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
            current = rs.worker_request_id == wrid  # not migrated meanwhile
            if current:
                rs.prefill_done = True
                p.inflight.discard(rid)
        if error is not None and current and rid in self.inflight and rs.lost is None:
            log.warning("request %s: %s", rid, error)
            rs.queue.put_nowait(TokenDelta(wrid, (), "error", error))
            self._abort_on(rs.decode_worker_id, wrid)

    def finish(self, request_id: str, abort: bool = False) -> None:
        """The gateway is done with the request. With `abort`, every worker that may still hold it
        is told to drop it (its KV blocks go back to the pool). Never blocks; safe to call twice."""
        rs = self.inflight.pop(request_id, None)
        if rs is None:
            return
        self.admission.release(request_id)
        self.token_stream.unregister(rs.worker_request_id)
        self._forget_placement(rs, abort)

    def _forget_placement(self, rs: RequestStream, abort: bool) -> None:
        """Takes the request off its workers' books (and, with `abort`, off the workers themselves)."""
        for wid in (rs.decode_worker_id, rs.prefill_worker_id):
            if wid is not None:
                self.views[wid].inflight.discard(rs.request_id)
        if abort:
            self._abort_on(rs.decode_worker_id, rs.worker_request_id)
            if rs.prefill_worker_id is not None and not rs.prefill_done:
                self._abort_on(rs.prefill_worker_id, rs.worker_request_id)

    async def migrate(self, rs: RequestStream, failure: TokenDelta) -> TokenDelta | None:
        """Places a request whose worker died again, as prompt + the tokens read so far; returns None
        when it runs again (its tokens follow on the same queue), else the delta that ends it."""
        why, rs.lost = rs.lost, None
        origin = rs.origin
        done = len(rs.generated)
        left = origin.params.max_tokens - done
        if rs.request_id not in self.inflight or not self.cfg.migrate_on_worker_death:
            return failure
        if left <= 0:
            return TokenDelta(rs.worker_request_id, (), "length")
        if rs.migrations >= self.cfg.max_migrations:
            return TokenDelta(rs.worker_request_id, (), "error", f"{why}; not migrated again after {rs.migrations} moves")
        # Nothing more from the old placement may reach the client (late tokens, the abort's delta).
        self.token_stream.unregister(rs.worker_request_id)
        self._forget_placement(rs, abort=True)  # whatever is left of it on a live worker
        rs.migrations += 1
        p = origin.params
        rs.request = GenerateRequest(
            f"{origin.request_id}.m{rs.migrations}", origin.prompt_token_ids + tuple(rs.generated),
            replace(p, max_tokens=left, min_tokens=max(0, p.min_tokens - done)), origin.seed, origin.arrival_time)
        rs.decode_worker_id = rs.prefill_worker_id = None
        rs.local_prefill = rs.prefill_done = False
        self.token_stream.attach(rs.worker_request_id, rs.queue)
        log.warning("request %s: %s; migrating with %d tokens so far as %s", rs.request_id, why, done,
                    rs.worker_request_id)
        try:
            await self._place(rs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return TokenDelta(rs.worker_request_id, (), "error", f"{why}; migration failed: {e}")
        if self.metrics:
            self.metrics.migrations.inc()
        return None

    def _abort_on(self, worker_id: str | None, request_id: str) -> None:
        if worker_id is None:
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
        await asyncio.gather(*(self._poll(v) for v in self.views.values()))
        self._polled_once = True
        if self.metrics:
            self.metrics.running.set(sum(v.stats.running for v in self.decode_views() if v.healthy))
            self.metrics.waiting.set(self.admission.num_waiting)

    async def _poll(self, v: WorkerView) -> None:
        try:
            stats = await self.clients[v.worker_id].call("stats", timeout=max(1.0, min(self.cfg.call_timeout_s, 10.0)))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._call_failed(v, e)
        else:
            was_healthy = v.healthy
            v.update(stats)
            if was_healthy and not v.healthy:
                self._fail_requests_on(v, "reported itself unhealthy")
        if self.metrics:
            self.metrics.observe_worker(v.stats, v.worker_id, v.role, v.healthy)

    async def alive(self, worker_id: str) -> bool:
        """Asks the worker now (a dead Ray actor answers at once with an error)."""
        v = self.views[worker_id]
        if v.healthy:
            try:
                await self.clients[worker_id].call("stats", timeout=max(1.0, min(self.cfg.call_timeout_s, 5.0)))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._call_failed(v, e)
                return not isinstance(e, _ActorDead)
        return v.healthy

    def _call_failed(self, v: WorkerView, e: BaseException) -> None:
        v.consecutive_failures += 1
        dead = isinstance(e, _ActorDead)
        if v.healthy and (dead or v.consecutive_failures >= self.cfg.unhealthy_after_failures):
            v.healthy = False
            log.error("worker %s is unhealthy: %s: %s", v.worker_id, e.__class__.__name__, e)
            self._fail_requests_on(v, "died" if dead else "stopped answering")

    def _fail_requests_on(self, v: WorkerView, why: str) -> None:
        """Ends (or, with migration on, moves) every request placed on a worker that failed."""
        for rid in list(v.inflight):
            rs = self.inflight.get(rid)
            if rs is None:
                continue
            msg = f"{v.role} worker {v.worker_id} {why}"
            if self.cfg.migrate_on_worker_death and rs.lost is None:
                rs.lost = msg
                # Late frames of the dead worker for this request must not reach the client.
                self.token_stream.unregister(rs.worker_request_id)
            rs.queue.put_nowait(TokenDelta(rs.worker_request_id, (), "error", msg))
        v.inflight.clear()
