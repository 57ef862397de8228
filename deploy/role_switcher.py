"""RoleSwitcher: moves one worker between prefill and decode while the cluster serves, on the GPU it
holds (GPUs are fixed; the worker's placement-group bundle is reused).

    drain    the router places nothing new on it; what it holds runs to the end (up to drain_timeout_s;
             what is still there then is failed over like a dead worker's: decode requests migrate
             with their tokens so far, queued prompts are placed again)
    remove   the router forgets it
    retire   its actor shuts down and is killed: the bundle's GPU is free
    spawn    an actor of the other role starts in that bundle under a new id, joins the KV transport
             group, warms up (before it is placed on, as at start-up)
    add      the router polls it and places on it

Every step runs on the router's event loop; the blocking Ray calls (retire, spawn) run in a thread.
The cluster object provides `retire_worker(id) -> bundle` and `spawn_worker(role, bundle) -> (id,
handle)` (deploy/serving_cluster.py's ServingCluster).
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.router import Router

log = logging.getLogger("pdserve.role_switch")


class RoleSwitcher:
    def __init__(self, cluster, router: Router, drain_timeout_s: float = 60.0):
        self.cluster = cluster
        self.router = router
        self.drain_timeout_s = drain_timeout_s

    async def switch(self, worker_id: str, to_role: str) -> str:
        """Returns the id of the worker now serving as `to_role` on worker_id's GPU."""
        router = self.router
        role = router.view(worker_id).role
        if role == to_role:
            raise ValueError(f"{worker_id} already is a {to_role} worker")
        if role == "decode" and sum(x.healthy and not x.draining for x in router.decode_views()) < 2:
            raise ValueError("switching the last decode worker would leave nothing to decode on")
        t0 = time.monotonic()
        router.drain_worker(worker_id)
        left = await router.wait_drained(worker_id, self.drain_timeout_s)
        router.remove_worker(worker_id)
        bundle = await asyncio.to_thread(self.cluster.retire_worker, worker_id)
        new_id, handle = await asyncio.to_thread(self.cluster.spawn_worker, to_role, bundle)
        await router.add_worker(self.cluster.worker_client(new_id, to_role, handle))
        log.info("role switch: %s -> %s %s in %.1fs (%d requests failed over after the drain)", worker_id, to_role,
                 new_id, time.monotonic() - t0, left)
        return new_id
