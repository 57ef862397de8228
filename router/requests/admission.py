"""AdmissionController: whether a request may enter the cluster now, the queue it waits in when it
does not fit yet, and every refusal the router answers a request with. Each outcome is one method
here (the HTTP mapping of the errors is the gateway's):

1. 400 when the request can never run (`check_request`): prompt + max_tokens beyond the model's
   context, or more KV blocks than the largest decode worker has in all.
2. 503 while the server drains (`check_open`: SIGTERM, RouterServer.drain), before anything else;
   the requests still queued then get it too (`draining = True`).
3. 503 when no decode worker is healthy (`check_healthy`).
4. Capacity (`admit`): a healthy decode worker has room for the prompt (its KV blocks plus the
   first decode slot, and a free batch slot), some prefill path (each prefill worker, each decode
   worker's local queue) would start the prompt's prefill within `max_prefill_queue_s`, and the
   tokens of every admitted, unfinished request (prompt + max_tokens) stay within
   `max_inflight_tokens`. All read the router's WorkerViews, which count the router's own placements
   and releases since the last poll, less what admission let in that is not placed yet (its claims).
5. A request that does not fit now waits in the admission queue (`enter`), as vLLM's and TGI's
   queue: first come, first served within one API server, round robin between API servers (one
   sending a burst does not hold back another's requests), woken whenever capacity may have come
   back (`pump`: every stats poll, every finished request, every placement). 429 with Retry-After
   only when the queue already holds `max_waiting_requests`, when the wait it would have (its place
   in the queue over the measured rate of admissions from it) passes `queue_timeout_s`, or once it
   has waited `queue_timeout_s`. A request cancelled while it waits (its client left) just leaves
   the queue: it holds nothing anywhere yet.
6. An admitted request that no decode worker takes within `reserve_wait_s` (the router's placement
   walk retries until then, router/requests/placement_walk.py; `check_placement_wait`) waits in the queue
   again, ahead of its source's later arrivals, while another attempt still ends within
   `queue_timeout_s` of its arrival (`can_requeue`; Router.submit): admission read a view a poll
   behind the worker, which refused. Then 429. A migration gets its 429 after `migration_wait_s`.

An admitted request holds a ticket until the gateway releases it (finished, failed, aborted or its
client gone), so the counters can't leak; `mark_running` moves it from admitted-without-a-first-token
to running at its first token.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from cluster.errors import InvalidRequestError
from cluster.kv.kv_blocks import blocks_for_tokens, decode_held_blocks
from cluster.kv.request_limits import check_request_fits
from router.errors import CapacityShortError, DrainingError, NoHealthyWorkerError, NotPlacedError, OverloadedError

if TYPE_CHECKING:  # annotations only: AdmissionLimits stays importable without torch (deploy/config.py)
    from router.placement.placement import WorkerView


@dataclass(frozen=True)
class AdmissionLimits:
    max_model_len: int
    block_size: int
    max_waiting_requests: int = 256  # requests the admission queue holds (beyond: 429)
    queue_timeout_s: float = 30.0  # longest wait in it (beyond, or expected beyond: 429)
    max_inflight_tokens: int = 1 << 20
    retry_after_s: int = 1
    max_prefill_queue_s: float = math.inf  # longest expected wait before a prompt's prefill starts


@dataclass
class _Ticket:
    tokens: int
    waiting: bool = True
    # (decode worker, KV blocks, batch slot) counted against that worker until the placement began
    # (`placed`): admissions decided before it see each other.
    claim: tuple[str, int] | None = None


@dataclass(eq=False)
class _Waiter:
    request_id: str
    source: str
    try_admit: Callable[[], None]  # admits (raises CapacityShortError while it does not fit)
    since: float
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionController:
    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self._tickets: dict[str, _Ticket] = {}
        self.num_waiting = 0  # admitted requests without a first token yet
        self.inflight_tokens = 0
        self._draining = False  # set on SIGTERM: new requests are refused (503)
        # The queue: per source (an API server), its waiters in arrival order; `_turns` the sources
        # with waiters in the order they are served next (round robin).
        self._queues: dict[str, deque[_Waiter]] = {}
        self._turns: deque[str] = deque()
        self._num_queued = 0
        self._left_queue: deque[float] = deque(maxlen=64)  # time.monotonic() of admissions from the queue
        self._pumping = False
        # Called when a request starts to wait: the router polls its workers at once (the decision was
        # on polled state; an idle server whose last poll predates a finish must not make it wait).
        self.on_queued: Callable[[], None] = lambda: None

    @property
    def num_admitted(self) -> int:
        return len(self._tickets)

    @property
    def num_queued(self) -> int:
        """Requests in the admission queue (`num_requests_waiting`)."""
        return self._num_queued

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, on: bool) -> None:
        self._draining = on
        if on:  # what still waits will not be admitted here: the client retries on another replica
            for q in list(self._queues.values()):
                for w in list(q):
                    if not w.admitted.done():
                        w.admitted.set_exception(DrainingError())

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.limits.block_size)

    def decode_blocks_for(self, num_tokens: int) -> int:
        """What a decode worker holds for a sequence of `num_tokens` tokens (cluster.kv.kv_blocks)."""
        return decode_held_blocks(num_tokens, self.limits.block_size)

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """Request-only checks (no cluster state): 400 when it can never run."""
        check_request_fits(prompt_len, max_tokens, self.limits.max_model_len)

    def check_open(self) -> None:
        """503 while the server drains."""
        if self._draining:
            raise DrainingError("the server is shutting down; retry on another replica")

    def check_healthy(self, decode_views: list[WorkerView]) -> list[WorkerView]:
        """503 when no decode worker is healthy; else the healthy ones."""
        healthy = [v for v in decode_views if v.healthy]
        if not healthy:
            raise NoHealthyWorkerError("no healthy decode worker is available")
        return healthy

    def check_placement_wait(self, waited_s: float, wait_s: float) -> None:
        """NotPlacedError once a placement has waited `wait_s` for a decode worker that takes the
        request: a new request then waits in the queue again (Router.submit), a migration gets a 429."""
        if waited_s >= wait_s:
            raise NotPlacedError(f"no decode worker could take the request within {wait_s:g}s; retry later",
                                 self.limits.retry_after_s)

    def can_requeue(self, since: float, wait_s: float) -> bool:
        """Whether a request queued since `since` (monotonic) that a placement refused may wait in the
        queue again: another placement attempt (`wait_s`) still ends within queue_timeout_s."""
        return self.limits.max_waiting_requests > 0 and time.monotonic() - since + wait_s < self.limits.queue_timeout_s

    # -- capacity, now ------------------------------------------------------------------------------
    def _claimed(self, worker_id: str) -> tuple[int, int]:
        """(KV blocks, batch slots) admitted onto the worker and not placed yet."""
        blocks = slots = 0
        for t in self._tickets.values():
            if t.claim is not None and t.claim[0] == worker_id:
                blocks += t.claim[1]
                slots += 1
        return blocks, slots

    def admit(self, request_id: str, prompt_len: int, max_tokens: int, decode_views: list[WorkerView],
              prefill_wait_s: float = 0.0) -> None:
        """Admits the request now, or raises: InvalidRequestError (400), NoHealthyWorkerError (503),
        CapacityShortError (it does not fit now: `enter` queues it). prefill_wait_s: the shortest
        expected wait before a prompt placed now starts its prefill (PrefillCostModel.best_queue_wait_s).

        A worker must have the prompt's blocks free even when it caches the prompt's prefix: a
        worker's free blocks include its evictable cached ones (a hit takes them out of that pool, so
        crediting the hit counted them twice), and the router's KV index may name blocks evicted since
        (its entries are reports, not pins). Either way the request was admitted into a reservation the
        worker refused, and got a 429 after reserve_wait_s instead of waiting here. The cost is that a
        prompt whose prefix is held by running requests waits for room it would not need."""
        self.check_request(prompt_len, max_tokens)
        if request_id in self._tickets:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        healthy = self.check_healthy(decode_views)
        check_request_fits(prompt_len, max_tokens, self.limits.max_model_len, block_size=self.limits.block_size,
                           kv_blocks=max(v.total_blocks for v in healthy), holder="any decode worker")
        lim = self.limits
        tokens = prompt_len + max_tokens
        if self.inflight_tokens and self.inflight_tokens + tokens > lim.max_inflight_tokens:
            raise CapacityShortError(
                f"too many tokens in flight ({self.inflight_tokens} + {tokens} > {lim.max_inflight_tokens}); "
                "retry later", lim.retry_after_s)
        need = self.decode_blocks_for(prompt_len)
        room = None
        for v in healthy:
            if v.draining:
                continue
            blocks, slots = self._claimed(v.worker_id)
            free = v.free_blocks - blocks
            if free >= need and (not v.stats.max_num_seqs or v.running + slots < v.stats.max_num_seqs):
                if room is None or free > room[1]:
                    room = (v.worker_id, free, need)
        if room is None:
            raise CapacityShortError(f"no decode worker has {need} free KV blocks and a batch slot for this prompt; "
                                     "retry later", lim.retry_after_s)
        if prefill_wait_s > lim.max_prefill_queue_s:
            raise CapacityShortError(
                f"the prefill queues are {prefill_wait_s:.1f}s deep (limit {lim.max_prefill_queue_s:g}s); retry later",
                lim.retry_after_s)
        self._tickets[request_id] = _Ticket(tokens, claim=(room[0], room[2]))
        self.num_waiting += 1
        self.inflight_tokens += tokens

    def placed(self, request_id: str) -> None:
        """The admitted request's placement began (or ended): the worker's view counts it from now,
        so its claim goes; waiting requests may fit now."""
        t = self._tickets.get(request_id)
        if t is not None and t.claim is not None:
            t.claim = None
            self.pump()

    # -- the queue ------------------------------------------------------------------------------------
    async def enter(self, request_id: str, source: str, try_admit: Callable[[], None],
                    since: float | None = None) -> float:
        """Admits the request (`try_admit` is `admit` with its arguments) at once if nobody waits and
        it fits, else queues it until it does; returns the seconds it waited. Raises what `admit`
        does (but CapacityShortError), OverloadedError (429) when the queue is full, when the wait
        would pass `queue_timeout_s` or once it has, DrainingError when the server starts draining.
        since: when the request first queued (monotonic), for one that waits again after a refused
        placement: its queue_timeout_s counts from then, and it goes ahead of its source's queue."""
        lim = self.limits
        again, entered = since is not None, time.monotonic()
        if not self._num_queued:  # first come, first served: nobody waits ahead of it
            try:
                try_admit()
                return 0.0
            except CapacityShortError:
                pass
        if self._num_queued >= lim.max_waiting_requests:
            raise OverloadedError(f"{self._num_queued} requests already wait for KV and prefill capacity "
                                  f"(max_waiting_requests={lim.max_waiting_requests}); retry later", lim.retry_after_s)
        expected = None if again else self.expected_wait_s(self._num_queued + 1)
        if expected is not None and expected > lim.queue_timeout_s:
            raise OverloadedError(f"the admission queue would hold this request about {expected:.0f}s "
                                  f"(queue_timeout_s={lim.queue_timeout_s:g}); retry later", lim.retry_after_s)
        w = _Waiter(request_id, source, try_admit, since if again else time.monotonic())
        q = self._queues.get(source)
        if q is None:
            q = self._queues[source] = deque()
            self._turns.append(source)
        if again:
            q.appendleft(w)
        else:
            q.append(w)
        self._num_queued += 1
        self.on_queued()
        try:
            self.pump()  # capacity may have come back since the last pump
            # NOTE: asyncio.wait neither cancels the future nor swallows our own cancellation.
            await asyncio.wait({w.admitted}, timeout=max(0.0, w.since + lim.queue_timeout_s - time.monotonic()))
        except BaseException:
            self._leave(w)
            if w.admitted.done() and not w.admitted.cancelled() and w.admitted.exception() is None:
                self.release(request_id)  # admitted at the moment its client left: undo it
            raise
        self._leave(w)
        if not w.admitted.done():
            raise OverloadedError(f"the request waited {lim.queue_timeout_s:g}s (queue_timeout_s={lim.queue_timeout_s:g}) for KV and "
                                  "prefill capacity; retry later", lim.retry_after_s)
        w.admitted.result()  # raises what admitting it raised (400, 503)
        return time.monotonic() - (w.since if not again else entered)

    def _leave(self, w: _Waiter) -> None:
        q = self._queues.get(w.source)
        if q is None or w not in q:
            return
        q.remove(w)
        self._num_queued -= 1
        if not q:
            del self._queues[w.source]
            self._turns.remove(w.source)

    def pump(self) -> None:
        """Admits queued requests while the one whose turn it is fits: the head of each source's
        queue in turn (round robin); none overtakes a head that does not fit. Called whenever
        capacity may have come back."""
        if self._pumping:
            return  # re-entered from a ticket released by a waiter's own failure
        self._pumping = True
        try:
            while self._turns:
                source = self._turns[0]
                q = self._queues[source]
                w = q[0]
                if not w.admitted.done():
                    try:
                        w.try_admit()
                    except CapacityShortError:
                        return
                    except Exception as e:  # noqa: BLE001 - it can never run (400), or no worker is healthy (503)
                        w.admitted.set_exception(e)
                    else:
                        w.admitted.set_result(None)
                        self._left_queue.append(time.monotonic())
                q.popleft()
                self._num_queued -= 1
                self._turns.popleft()
                if q:
                    self._turns.append(source)
                else:
                    del self._queues[source]
        finally:
            self._pumping = False

    def expected_wait_s(self, position: int) -> float | None:
        """Seconds a request at `position` in the queue would wait, from the rate requests left it
        over the last 30 s (None while that rate is not known: fewer than 4 admissions from it)."""
        now = time.monotonic()
        recent = [t for t in self._left_queue if now - t < 30.0]
        if len(recent) < 4 or recent[-1] <= recent[0]:
            return None
        rate = (len(recent) - 1) / (recent[-1] - recent[0])
        return position / rate

    # -- tickets ------------------------------------------------------------------------------------
    def mark_running(self, request_id: str) -> None:
        t = self._tickets.get(request_id)
        if t is not None and t.waiting:
            t.waiting = False
            self.num_waiting -= 1

    def release(self, request_id: str) -> None:
        t = self._tickets.pop(request_id, None)
        if t is None:
            return
        if t.waiting:
            self.num_waiting -= 1
        self.inflight_tokens -= t.tokens
        self.pump()
