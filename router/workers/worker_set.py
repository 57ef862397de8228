"""WorkerSet: the router's workers by role, each with its client (how to call it) and its view (what
the router knows of it: router.placement.placement.WorkerView).

The Router changes it (workers join and leave while it serves: the P:D planner's role switches);
its placement walk, its health checks and its migrations read it. Ids keep the order in which the
workers joined.
"""

from __future__ import annotations

from cluster.wire.messages import WorkerStats
from router.placement.placement import WorkerView
from router.workers.worker_client import WorkerClient

ROLES = ("prefill", "decode")


class WorkerSet:
    def __init__(self, prefill: list[WorkerClient], decode: list[WorkerClient]):
        if len({c.worker_id for c in [*prefill, *decode]}) != len(prefill) + len(decode):
            raise ValueError("worker ids must be unique")
        self.clients: dict[str, WorkerClient] = {}
        self.views: dict[str, WorkerView] = {}
        self._ids: dict[str, list[str]] = {role: [] for role in ROLES}
        for c in [*prefill, *decode]:
            self.add(c)

    def add(self, client: WorkerClient) -> WorkerView:
        """The worker joins, unhealthy until its first stats poll answers."""
        if client.worker_id in self.clients:
            raise ValueError(f"worker id {client.worker_id!r} is already in use")
        if client.role not in ROLES:
            raise ValueError(f"worker {client.worker_id!r} has role {client.role!r}, not one of {ROLES}")
        self.clients[client.worker_id] = client
        v = self.views[client.worker_id] = WorkerView(client.worker_id, client.role,
                                                      WorkerStats(client.worker_id, client.role, healthy=False))
        self._ids[client.role].append(client.worker_id)
        return v

    def remove(self, worker_id: str) -> WorkerView:
        v = self.views.pop(worker_id)
        del self.clients[worker_id]
        self._ids[v.role].remove(worker_id)
        return v

    def ids(self, role: str) -> list[str]:
        return self._ids[role]

    def of(self, role: str) -> list[WorkerView]:
        return [self.views[w] for w in self._ids[role]]

    def healthy_peers(self, role: str) -> list[str]:
        """Ids of the healthy workers of the other role (those a worker of `role` transfers KV with)."""
        other = "decode" if role == "prefill" else "prefill"
        return [w for w in self._ids[other] if self.views[w].healthy]
