"""Migrator: moves a request whose worker failed it to another worker, without the client noticing.

A request whose decode worker dies (or fails it through a failure of its own: a loop exception) is
migrated when `migrate_on_worker_death` is on: WorkerHealth marks it lost and tells its gateway,
which stops taking the dead placement's tokens at once and calls `migrate` with every token the
client already got. The request is placed again as prompt + those tokens, with max_tokens less
those and the same seed, under the worker-side id the gateway chose (`<id>.m<k>`); the stream
continues from the next token, so there is no gap and no duplicate, and greedy or seeded output is
what it would have been. A request whose prefill worker dies, or whose prompt's computation or KV
transfer fails, is placed again the same way (nothing generated yet), not through that prefill and
decode pair. At most `max_migrations` moves per request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable

from router.stats.metrics import RouterMetrics
from router.placed_request import PlacedRequest
from router.requests.placement_walk import PlacementWalk
from router.router_config import RouterConfig
from router.workers.worker_health import WorkerHealth

log = logging.getLogger(__name__)


class Migrator:
    def __init__(self, cfg: RouterConfig, inflight: dict[str, PlacedRequest], health: WorkerHealth,
                 walk: PlacementWalk, forget_placement: Callable[[PlacedRequest], None],
                 metrics: RouterMetrics | None = None):
        """inflight: the router's admitted requests (shared). forget_placement: takes a request off
        its workers' books and aborts whatever is left of it on them."""
        self.cfg = cfg
        self.inflight = inflight
        self.health = health
        self.walk = walk
        self.forget_placement = forget_placement
        self.metrics = metrics

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
                and not await self.health.alive(rs.prefill_worker_id)):
            # The decode side may see a transfer break (and fail the request) before the router has
            # noticed that the prefill worker died: nothing was streamed yet, so run it elsewhere.
            rs.lost = f"prefill worker {rs.prefill_worker_id} died"
        if rs.lost is None and rs.decode_worker_id in self.health.workers.views:
            # A failure reported before the router saw its cause: the decode worker may have died or
            # restarted meanwhile (a new incarnation answers lost() with False: it never had the
            # request). A poll now finds either, and marks its requests lost.
            await self.health.poll(self.health.workers.views[rs.decode_worker_id])
        if rs.lost is None and rs.decode_worker_id is not None and await self.health.lost_on(
                rs.decode_worker_id, worker_request_id=rs.worker_request_id):
            # Its decode worker failed it for a failure of its own (a loop exception, the process
            # alive): moved like a dead worker's request.
            rs.lost = failure
        if rs.lost is None or not self.cfg.migrate_on_worker_death:
            return "error", failure
        why, rs.lost = rs.lost, None
        # The placement that failed made no token of its own (what a migrated request resumed with is
        # not its): its KV transfer failed on that pair, which the next placement avoids. (Counting
        # every token instead sent a migrated request back through the same dead pair until
        # max_migrations ran out: the chaos "transfer" fault, 1 error in 205 requests.) A transfer
        # that failed after the prefill worker sent the first token is avoided by PlacementWalk,
        # which sees the failure (here that token counts as made).
        made_here = len(generated) - rs.request.resumed_tokens
        if made_here <= 0 and rs.prefill_worker_id is not None and rs.decode_worker_id is not None:
            rs.avoid_pairs.add((rs.prefill_worker_id, rs.decode_worker_id))
        origin = rs.origin
        done = len(generated)
        left = origin.params.max_tokens - done
        if left <= 0:
            return "length", None
        if rs.migrations >= self.cfg.max_migrations:
            return "error", f"{why}; not migrated again after {rs.migrations} moves"
        self.forget_placement(rs)  # whatever is left of it on a live worker
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
            # While a decode worker is down but not gone (Ray restarts it), a migration waits for it.
            await self.walk.place(rs, self.cfg.migration_wait_s, wait_for_restart=self.health.may_come_back("decode"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return "error", f"{why}; migration failed: {e}"
        if self.metrics:
            self.metrics.migrations.inc()
        return None
