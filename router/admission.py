"""AdmissionController: whether a request may enter the cluster now, and every refusal the router
answers a request with. Each outcome is one method here (the HTTP mapping of the errors is the
gateway's):

1. 400 when the request can never run (`check_request`): prompt + max_tokens beyond the model's
   context, or more KV blocks than the largest decode worker has in all.
2. 503 while the server drains (`check_open`: SIGTERM, RouterServer.drain), before anything else.
3. 503 when no decode worker is healthy (`check_healthy`).
4. 429 (with Retry-After) when the router already holds `max_waiting_requests` requests that have
   no first token yet, or when admitting would exceed `max_inflight_tokens` (prompt + max_tokens of
   every admitted, unfinished request).
5. 429 from the workers' state (`CapacityShortError`): no healthy decode worker has room for the
   prompt (plus the first decode slot) right now, or every prefill path (each prefill worker, each
   decode worker's local queue) would make the prompt wait more than `max_prefill_queue_s` before its
   prefill starts. Both read the router's WorkerViews, which count the router's own placements and
   releases since the last poll; before it answers 429 on these grounds the router re-polls the
   workers (waiting a fraction of a second at most) and asks once more.
6. 429 once an admitted request has waited `reserve_wait_s` (a migration: `migration_wait_s`) for a
   decode worker that takes it (`check_placement_wait`: the router's placement walk retries until
   then, router/placement_walk.py).

`admit` applies 1, 3, 4 and 5. An admitted request holds a ticket until the gateway releases it
(finished, failed, aborted or its client gone), so the counters can't leak; `mark_running` moves it
from waiting to running at its first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.errors import InvalidRequestError
from cluster.request_limits import check_request_fits
from router.errors import CapacityShortError, DrainingError, NoHealthyWorkerError, OverloadedError

if TYPE_CHECKING:  # annotations only: AdmissionLimits stays importable without torch (deploy/config.py)
    from router.placement import WorkerView


@dataclass(frozen=True)
class AdmissionLimits:
    max_model_len: int
    block_size: int
    max_waiting_requests: int = 256
    max_inflight_tokens: int = 1 << 20
    retry_after_s: int = 1
    max_prefill_queue_s: float = math.inf  # longest expected wait before a prompt's prefill starts


@dataclass
class _Ticket:
    tokens: int
    waiting: bool = True


class AdmissionController:
    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self._tickets: dict[str, _Ticket] = {}
        self.num_waiting = 0
        self.inflight_tokens = 0
        self.draining = False  # set on SIGTERM: new requests are refused (503)

    @property
    def num_admitted(self) -> int:
        return len(self._tickets)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.limits.block_size)

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """Request-only checks (no cluster state): 400 when it can never run."""
        check_request_fits(prompt_len, max_tokens, self.limits.max_model_len)

    def check_open(self) -> None:
        """503 while the server drains."""
        if self.draining:
            raise DrainingError("the server is shutting down; retry on another replica")

    def check_healthy(self, decode_views: list[WorkerView]) -> list[WorkerView]:
        """503 when no decode worker is healthy; else the healthy ones."""
        healthy = [v for v in decode_views if v.healthy]
        if not healthy:
            raise NoHealthyWorkerError("no healthy decode worker is available")
        return healthy

    def check_placement_wait(self, waited_s: float, wait_s: float) -> None:
        """429 once a placement has waited `wait_s` for a decode worker that takes the request."""
        if waited_s >= wait_s:
            raise OverloadedError(f"no decode worker could take the request within {wait_s:g}s; retry later",
                                  self.limits.retry_after_s)

    def admit(self, request_id: str, prompt_len: int, max_tokens: int, decode_views: list[WorkerView],
              prefill_wait_s: float = 0.0, cached_blocks: dict[str, int] | None = None) -> None:
        """prefill_wait_s: the shortest expected wait before a prompt placed now starts its prefill
        (PrefillCostModel.best_queue_wait_s). cached_blocks: the prompt's leading blocks each decode
        worker holds in its prefix cache (router.kv_index); a worker needs only the rest free."""
        self.check_request(prompt_len, max_tokens)
        if request_id in self._tickets:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        healthy = self.check_healthy(decode_views)
        check_request_fits(prompt_len, max_tokens, self.limits.max_model_len, block_size=self.limits.block_size,
                           kv_blocks=max(v.total_blocks for v in healthy), holder="any decode worker")
        lim = self.limits
        if self.num_waiting >= lim.max_waiting_requests:
            raise OverloadedError(f"too many waiting requests ({self.num_waiting}); retry later", lim.retry_after_s)
        tokens = prompt_len + max_tokens
        if self.inflight_tokens and self.inflight_tokens + tokens > lim.max_inflight_tokens:
            raise OverloadedError(
                f"too many tokens in flight ({self.inflight_tokens} + {tokens} > {lim.max_inflight_tokens}); "
                "retry later", lim.retry_after_s)
        need = self.blocks_for(prompt_len + 1)
        cached = cached_blocks or {}
        if not any(v.free_blocks >= need - cached.get(v.worker_id, 0) for v in healthy if not v.draining):
            raise CapacityShortError(f"no decode worker has {need} free KV blocks for this prompt; retry later",
                                     lim.retry_after_s)
        if prefill_wait_s > lim.max_prefill_queue_s:
            raise CapacityShortError(
                f"the prefill queues are {prefill_wait_s:.1f}s deep (limit {lim.max_prefill_queue_s:g}s); retry later",
                lim.retry_after_s)
        self._tickets[request_id] = _Ticket(tokens)
        self.num_waiting += 1
        self.inflight_tokens += tokens

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
