"""PlannerLoop: runs the P:D planner (router.placement.pd_planner) beside the router and carries out its
decisions with the RoleSwitcher, one worker at a time.

Every `interval_s`: observe (the router's views of its workers: measured rates; its ArrivalStats:
the request mix, over the `planner_window_s` window the launcher creates the router with) ->
PDPlanner.decide -> if it asks for a change, switch the least busy healthy worker of the role that
shrinks (fewest requests placed on it) and tell the planner when done.
"""

from __future__ import annotations

import asyncio
import logging
import time

from deploy.role_switcher import RoleSwitcher
from router.placement.pd_planner import PDPlanner, PlannerConfig, observe
from router.router import Router

log = logging.getLogger("pdserve.planner")


class PlannerLoop:
    def __init__(self, router: Router, switcher: RoleSwitcher, planner: PDPlanner, interval_s: float,
                 block_size: int, metrics=None, clock=time.monotonic):
        self.router = router
        self.switcher = switcher
        self.planner = planner
        self.interval_s = interval_s
        self.block_size = block_size
        self.metrics = metrics
        self.clock = clock

    @classmethod
    def for_cluster(cls, cluster, router: Router, metrics=None) -> "PlannerLoop":
        c = cluster.cfg
        planner = PDPlanner(PlannerConfig(
            min_prefill=c.planner_min_prefill_workers, hysteresis=c.planner_hysteresis,
            confirmations=c.planner_confirmations, min_dwell_s=c.planner_min_dwell_s,
            tpot_target_s=c.planner_tpot_target_s))
        return cls(router, RoleSwitcher(cluster, router, c.planner_drain_timeout_s), planner, c.planner_interval_s,
                   c.block_size, metrics)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("planner step failed")

    async def step(self) -> str | None:
        """One evaluation; returns the id of the worker it started if it switched one."""
        r = self.router
        inputs = observe(r.prefill_views(), r.decode_views(), r.arrivals.mix(), self.block_size,
                         self.planner.cfg.tpot_target_s)
        change = self.planner.decide(self.clock(), inputs)
        if change is None:
            return None
        views = r.prefill_views() if change.from_role == "prefill" else r.decode_views()
        candidates = [v for v in views if v.healthy and not v.draining]
        if not candidates:
            return None
        victim = min(candidates, key=lambda v: (len(v.inflight), v.outstanding_prefill_tokens, v.worker_id))
        log.info("planner: %s -> %s (split %s -> %s, bottleneck %.2f -> %.2f)", victim.worker_id, change.to_role,
                 (inputs.n_prefill, inputs.n_decode), change.target, change.bottleneck_now, change.bottleneck_target)
        new_id = await self.switcher.switch(victim.worker_id, change.to_role)
        split = (len(r.prefill_ids), len(r.decode_ids))
        self.planner.changed(self.clock(), split)
        if self.metrics is not None:
            self.metrics.role_switches.inc()
        return new_id
