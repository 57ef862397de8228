"""PlacementWalk: places an admitted request on a decode worker, its prompt prefilled there or on a
prefill worker.

The walk: rank the decode workers (router.placement.placement's decode policy) and, for each in turn, decide
where the prompt is prefilled (router.placement.local_prefill_policy over router.placement.prefill_cost_model) ->
- local: `D.submit_local` (D prefills it in chunks between its decode steps);
- remote: `P.submit` at once (a Dispatch: P computes the prompt and sends its first token to the
  gateway meanwhile) and `D.reserve` (blocks for the prompt) concurrently; D's reservation then goes
  to P (`P.attach`, which may reach P before the submit does: prefill_worker/calls_ahead.py), which
  ships the KV into the reserved blocks and returns timings. The
  reservation is off the first token's path: it costs a Ray round trip, the prompt's pass longer;
a None from D means it is full now: the next D in the ranking is tried, and D is not ranked again
until a fresh poll. When no D takes it, the walk waits a poll interval and walks again, until
admission's reserve-wait rule answers 429 (or 503 once no decode worker is healthy).

The walk's decisions are those it made when P was called only after D's reservation: a refused or
failed reservation leaves the dispatched prompt on P (computed, its blocks held there), and the next D
whose choice is the same P gets it; a choice of local prefill or of another P (or the walk ending
unplaced: 429, 503, cancelled) aborts it on P first. Its first token waits in the request's mailbox
at the gateway, which reads it only once the walk placed the request (Gateway.start_generation), so
a request refused after its prompt computed has sent its client nothing. P's answer is acted on
(`_run_prefill`: migration, the gateway's PrefillDone) only for a dispatch the walk placed.

Every placement is counted on the workers' views from the moment it is decided (WorkerView.begin),
before the call goes out, so that concurrent placements awaiting their calls see each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from dataclasses import dataclass, field

from cluster.wire.messages import GenerateRequest, PrefillResult, PrefillTask, Reservation, ReserveRequest
from router.requests.admission import AdmissionController
from router.stats.arrival_stats import ArrivalStats
from router.placement.kv_index import KVBlockIndex
from router.placement.local_prefill_policy import LOCAL_PREFILL_POLICIES
from router.stats.metrics import RouterMetrics
from router.placed_request import Notify, PlacedRequest, Prefilled
from router.placement.placement import PlacementPolicies, WorkerView
from router.placement.prefill_cost_model import PrefillCostModel
from router.router_config import RouterConfig
from router.workers.worker_health import Spawn, WorkerHealth
from router.workers.worker_set import WorkerSet

log = logging.getLogger(__name__)

# (worker id, worker-side request id, error or None): drops the request on that worker, in the
# background; with an error, a decode worker ends its stream with it (router.Router.abort_on).
AbortOn = Callable[[str | None, str, str | None], None]


@dataclass
class Dispatch:
    """A prompt sent to prefill worker `p` ahead of its decode worker's reservation. `placed`
    resolves to True once a reservation was handed to P for it (the walk placed the request), to
    False once the walk gave it up (P was told to abort it)."""

    p: WorkerView
    placed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def settle(self, placed: bool) -> None:
        if not self.placed.done():
            self.placed.set_result(placed)


class PlacementWalk:
    def __init__(self, workers: WorkerSet, cfg: RouterConfig, policies: PlacementPolicies,
                 admission: AdmissionController, health: WorkerHealth, kv_index: KVBlockIndex, arrivals: ArrivalStats,
                 inflight: dict[str, PlacedRequest], notify: Notify, prefilled: Prefilled, abort_on: AbortOn,
                 spawn: Spawn, metrics: RouterMetrics | None = None):
        """inflight: the router's admitted requests (shared). notify / prefilled: tell a request's
        gateway that a worker failed it / that its prompt is computed."""
        self.workers = workers
        self.cfg = cfg
        self.policies = policies
        self.prefill_choice = LOCAL_PREFILL_POLICIES.create(cfg.prefill_placement, threshold=cfg.local_prefill_threshold)
        self.cost = PrefillCostModel(cfg.itl_cost_weight)
        self.admission = admission
        self.health = health
        self.kv_index = kv_index
        self.arrivals = arrivals
        self.inflight = inflight
        self.notify = notify
        self.prefilled = prefilled
        self.abort_on = abort_on
        self.spawn = spawn
        self.metrics = metrics

    def cached_blocks(self, req: GenerateRequest, role: str = "decode") -> dict[str, int]:
        """The prompt's leading blocks each worker of `role` reported caching (empty when no policy
        keeps the index for it): a decode worker holding them needs only the rest of the prompt's
        blocks free, as its reservation pins the cached ones; a cached prefix is not computed again
        (the prefill cost model). Stale entries only cost a refused reservation or a misestimate."""
        if role not in self.policies.indexed_roles or self.kv_index.block_size is None:
            return {}
        return self.kv_index.overlap(self.kv_index.hashes(req.prompt_token_ids), self.workers.ids(role))

    async def place(self, rs: PlacedRequest, wait_s: float | None = None, wait_for_restart: bool = False) -> None:
        """Places the request, waiting up to `wait_s` (default reserve_wait_s) for a decode worker with
        room. A migration waits longer (migration_wait_s): the request was admitted, its client is
        still reading, and the blocks it needs may be held by the dead worker's transfers a moment more.
        With `wait_for_restart` it also waits while no decode worker is healthy (one is restarting)."""
        req = rs.request
        prompt_len = len(req.prompt_token_ids)
        need = self.admission.decode_blocks_for(prompt_len)
        cached = self.cached_blocks(req)
        bs = self.kv_index.block_size or 0
        cached_tokens = {w: n * bs for w, n in {**self.cached_blocks(req, "prefill"), **cached}.items()}
        wait_s = self.cfg.reserve_wait_s if wait_s is None else wait_s
        started = time.monotonic()
        mean_output = self.arrivals.mix().mean_output_tokens or req.params.max_tokens
        dispatch: Dispatch | None = None  # the prompt on a prefill worker, not placed yet
        try:
            while True:
                prefill_ranked = self.policies.prefill.rank(self.workers.of("prefill"), req)
                for d in self.policies.decode.rank(self.workers.of("decode"), req, need):
                    ranked = [p for p in prefill_ranked if (p.worker_id, d.worker_id) not in rs.avoid_pairs]
                    choice = self.prefill_choice.choose(prompt_len, d, ranked, self.cost, mean_output, cached_tokens)
                    rs.decode_worker_id = d.worker_id
                    # What the placement takes out of the worker's free blocks until its next stats
                    # report: all of the prompt's, cached or not (a hit pins evictable cached blocks,
                    # which the worker counts as free; AdmissionController.admit says why).
                    new_blocks = need
                    if dispatch is not None and (choice.local or choice.prefill.worker_id != dispatch.p.worker_id):
                        dispatch = self._give_up(rs, dispatch)
                    if choice.local:
                        ok = await self._try_local(rs, d, new_blocks)
                    else:
                        dispatch = dispatch or self._dispatch(rs, choice.prefill)
                        ok = await self._try_disaggregated(rs, d, dispatch, new_blocks)
                    if ok:
                        dispatch = None  # placed (or none)
                        if self.metrics:
                            self.metrics.prefill_placed("local" if choice.local else "remote", choice.reason)
                        return
                rs.decode_worker_id = None
                if not wait_for_restart:
                    self.admission.check_healthy(self.workers.of("decode"))
                self.admission.check_placement_wait(time.monotonic() - started, wait_s)
                await asyncio.sleep(self.cfg.stats_interval_s)
        finally:
            if dispatch is not None:  # not placed (429, 503, a worker's refusal, cancelled)
                self._give_up(rs, dispatch)

    async def _try_local(self, rs: PlacedRequest, d: WorkerView, need: int) -> bool:
        wrid = rs.worker_request_id
        d.begin(wrid, need, len(rs.request.prompt_token_ids))
        self.admission.placed(rs.request_id)  # the view counts it now: admission's claim goes
        try:
            cached = await self.workers.clients[d.worker_id].submit_local(rs.request, timeout=self.cfg.call_timeout_s)
        except Exception as e:
            d.rollback(wrid)
            self._raise_refusal(rs, e)
            self.health.call_failed(d, e)
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

    def _dispatch(self, rs: PlacedRequest, p: WorkerView) -> Dispatch:
        """Sends the prompt to P now, before any decode worker reserved for it (see the module
        docstring)."""
        dispatch = Dispatch(p)
        p.begin(rs.worker_request_id, 0, len(rs.request.prompt_token_ids))  # acked as the call goes out
        rs.prefill_worker_id = p.worker_id
        self.spawn(self._run_prefill(rs, p, PrefillTask(rs.request), dispatch.placed))
        return dispatch

    def _give_up(self, rs: PlacedRequest, dispatch: Dispatch) -> None:  # -> None: `dispatch = self._give_up(...)`
        """The walk will not place the dispatched prompt: P drops it (its blocks, the task's answer)."""
        dispatch.settle(False)
        self.abort_on(dispatch.p.worker_id, rs.worker_request_id, None)
        if rs.prefill_worker_id == dispatch.p.worker_id:
            rs.prefill_worker_id = None
        return None

    async def _try_disaggregated(self, rs: PlacedRequest, d: WorkerView, dispatch: Dispatch, need: int) -> bool:
        wrid, p = rs.worker_request_id, dispatch.p
        # P's view counts the prompt during each try and not between them, as when P was called
        # after D's reservation: what the next D's choice ranks is what it ranked then.
        if wrid not in p.placing:  # a try after a refused one: the call to P is out already
            p.begin(wrid, 0, len(rs.request.prompt_token_ids))
            p.ack(wrid)
        d.begin(wrid, need, 0)
        self.admission.placed(rs.request_id)  # the view counts it now: admission's claim goes
        call = asyncio.ensure_future(self.workers.clients[d.worker_id].reserve(
            ReserveRequest(rs.request, p.worker_id), timeout=self.cfg.call_timeout_s))
        try:
            res: Reservation | None = await asyncio.shield(call)
        except BaseException as e:
            d.rollback(wrid)
            p.rollback(wrid)
            if isinstance(e, Exception):
                self._raise_refusal(rs, e)
                self.health.call_failed(d, e)
                return False
            # NOTE: cancelled (the client left) while D reserved. Once D has reserved, P must hear of
            # it, or the blocks stay reserved until D's expect timeout. The reservation finishes in
            # the background and is handed to P after the abort `place` sends it on the way out; in
            # whichever order P runs the two (and the submit), it aborts the transfer
            # (prefill_worker/calls_ahead.py).
            call.add_done_callback(lambda f: self._hand_off_orphan(f, rs, p))
            raise
        if res is None:
            d.rollback(wrid)
            p.rollback(wrid)
            self._refused(d)
            return False
        d.ack(wrid, len(res.block_ids))
        self._placed(rs, d)
        p.inflight.add(rs.request_id)
        p.placed_total += 1
        self.spawn(self._attach(rs, p, res))
        dispatch.settle(True)
        return True

    async def _attach(self, rs: PlacedRequest, p: WorkerView, res: Reservation) -> None:
        """Hands D's reservation to P. A failed call needs nothing here: P's task fails too (a dead
        P), or P answers it when its KV cannot go (`_run_prefill` acts on either)."""
        try:
            await self.workers.clients[p.worker_id].attach(res.request_id, res, timeout=self.cfg.call_timeout_s)
        except Exception as e:  # noqa: BLE001
            log.warning("request %s: reservation not handed to prefill worker %s: %s", rs.request_id, p.worker_id, e)

    @staticmethod
    def _raise_refusal(rs: PlacedRequest, e: Exception) -> None:
        """A worker's refusal of this one request (an error class with `worker_refusal`, e.g. the 429
        of a worker whose grammar compiles are all taken) ends the placement with it: the request is
        refused, and the worker is not counted as failing."""
        cause = getattr(e, "cause", e)  # (Ray wraps what an actor raised; .cause is the original)
        if getattr(cause, "worker_refusal", False):
            rs.decode_worker_id = None
            raise cause from None

    def _hand_off_orphan(self, call: asyncio.Future, rs: PlacedRequest, p: WorkerView) -> None:
        """A reservation made for a request that was given up meanwhile: P, which dropped the prompt
        already (the walk's abort went first), tells D there is no KV (PrefillWorkerAPI.attach)."""
        if call.cancelled() or call.exception() is not None or call.result() is None:
            return
        self.spawn(self._attach(rs, p, call.result()))

    def _placed(self, rs: PlacedRequest, d: WorkerView) -> None:
        d.placed_total += 1
        d.inflight.add(rs.request_id)

    def _refused(self, d: WorkerView) -> None:
        # D is full right now: not ranked again until a fresh poll says otherwise (asked at once).
        d.refused = True
        self.spawn(self.health.poll(d))
        if self.metrics:
            self.metrics.reserve_retries.inc()

    async def _run_prefill(self, rs: PlacedRequest, p: WorkerView, task: PrefillTask, placed: asyncio.Future) -> None:
        """P's task, from the dispatch to its answer (once its KV left, or it failed); acted on once
        the walk says whether it placed this dispatch (`placed`)."""
        rid, wrid = rs.request_id, rs.worker_request_id
        error = None
        result: PrefillResult | None = None
        try:
            # NOTE: acked when the call goes out, not when it returns (after prefill + transfer). P is
            # an async actor, whose calls Ray runs in no fixed order: a stats poll issued after this
            # line may still miss the prompt (its view under-counts it until the next poll), and the
            # attach or abort sent after it may reach P first (prefill_worker/calls_ahead.py).
            p.ack(wrid)
            rs.dispatched_time = time.time()
            result: PrefillResult = await self.workers.clients[p.worker_id].submit(task,
                                                                                   timeout=self.cfg.prefill_timeout_s)
            if not result.ok:
                error = result.error or "prefill failed"
            elif result.transfer_s > 0:
                self.cost.observe_transfer(len(task.request.prompt_token_ids), result.transfer_s)
            if result.ok and self.metrics:  # its queue and prefill phases are observed when it finishes
                self.metrics.kv_transfer.observe(result.transfer_s)
                self.metrics.kv_transfer_size.observe(result.transfer_bytes)
                self.metrics.kv_transfer_bytes.inc(result.transfer_bytes)
        except asyncio.CancelledError:
            p.forget(wrid)
            raise
        except Exception as e:
            error = f"prefill worker {p.worker_id} failed: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.health.call_failed(p, e)
        try:
            # P answers a prompt whose walk is still reserving only when it failed (it ships nothing
            # before a reservation): the walk decides first whether this dispatch is the placement.
            was_placed = await placed
        finally:
            p.forget(wrid)
        if not was_placed:
            return  # given up (P was told to abort it): nothing to report
        if result is not None:
            rs.prefill_result = result
        current = rs.worker_request_id == wrid  # not migrated meanwhile
        if current:
            rs.prefill_done = True
            p.inflight.discard(rid)
            # Sent whatever the outcome, also for a request its gateway already finished: the
            # gateway's reply waits for it (the decode worker's last token may come first).
            rs.cached_tokens = result.cached_tokens if result is not None else 0
            self.prefilled(rs)
        if error is not None and current and rid in self.inflight and rs.lost is None:
            log.warning("request %s: %s", rid, error)
            if self.cfg.migrate_on_worker_death:
                # The prompt's computation or its KV transfer failed (its first token may have reached
                # the client already: the prefill worker sends it before the commit): a failure of the
                # cluster, not of the request. Its gateway's Migrate places it again, never through
                # this pair again (a wedged pair fails every transfer until it is formed anew).
                rs.lost = error
                if rs.decode_worker_id is not None:
                    rs.avoid_pairs.add((p.worker_id, rs.decode_worker_id))
            self.notify(rs, error)
            # HAZARD: the notice and the decode worker's end of the placement reach the gateway on two
            # channels, in either order. Ended as a plain abort, a stream read before the notice
            # finished as if complete, with no text (CI, test_prefill_worker_death_retries_elsewhere):
            # ended with the same error, either one makes the gateway migrate (or end) the request.
            self.abort_on(rs.decode_worker_id, wrid, error)
