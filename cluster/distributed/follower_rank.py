"""FollowerRank: what rank 1..N-1 of a tensor-parallel worker is, whatever its role: it joins the
group, serves rank 0's transport calls (its payload agent, cluster/transport/tp_payload.py), loads its
part of the model and of the KV cache, then runs every pass rank 0 announces (follower.py) until the
group stops. A role's follower (decode_worker/rank_follower.py, prefill_worker/rank_follower.py) says
only how it runs each kind of pass (`handlers`).

As a Ray actor (deploy/ray_workers.py starts it from rank 0's actor, in the worker's bundle) the loop
runs on a thread of its own; `run_rank` runs it in a spawned process instead (tests, benchmarks).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from cluster.distributed.follower import RankFollower
from cluster.distributed.rank_launcher import exit_now
from cluster.transport.tp_payload import AgentHost
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.worker_model import WorkerModel, join_group, rank_config

log = logging.getLogger(__name__)


class FollowerRank(ABC):
    role = ""  # "prefill" / "decode": for the log

    def __init__(self, worker_id: str, cfg: WorkerConfig, rank: int, rendezvous, *, start: bool = True, **options):
        self.worker_id, self.rank = worker_id, rank
        self.group = join_group(cfg, rank, rendezvous, **options)
        # This rank's part of the KV transport: it serves rank 0's calls from now on (its cache is
        # there before rank 0 can call: rank 0's own start-up waits for this rank's collectives).
        self._loaded = threading.Event()
        self.calls = AgentHost(self.group, self._loaded_kv_cache)
        self.cfg = rank_config(cfg, rank)
        # NOTE: loading the model and what `handlers` builds (graph capture) run collectives: the same,
        # in the same order, as rank 0's start-up.
        try:
            self.wm = WorkerModel.load(self.cfg, self.group)
        finally:
            self._loaded.set()
        self.follower = RankFollower(self.group, self.handlers())
        self._thread = threading.Thread(target=self.run, name=f"tp-follower-{worker_id}-{rank}", daemon=True)
        if start:
            self._thread.start()

    @abstractmethod
    def handlers(self) -> dict[type, Callable]:
        """Per step-message type (cluster/distributed/step_messages.py), how this rank runs it."""

    @property
    def kv_cache(self):
        return self.wm.kv_cache

    def _loaded_kv_cache(self):
        """The KV cache for rank 0's Attach (the RPC thread). HAZARD: rank 0 goes on once this rank
        passed the last collective of WorkerModel.load, so its Attach can arrive before the load has
        returned here (seen on a loaded 2-core machine: no attribute 'wm'); it waits for the load."""
        self._loaded.wait()
        if not hasattr(self, "wm"):
            raise RuntimeError(f"rank {self.rank} of {self.worker_id} failed to load its model")
        return self.wm.kv_cache

    def run(self) -> str:
        why = self.follower.run()
        log.info("%s rank %d of %s stopped: %s", self.role, self.rank, self.worker_id, why)
        self.calls.close()
        self.group.close()
        return why

    def ready(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"rank": self.rank, "passes": self.follower.passes, "stopped": self.follower.stopped,
                "failed": self.group.failed}

    @classmethod
    def run_rank(cls, rank: int, rendezvous, worker_id: str, cfg: WorkerConfig) -> None:
        """A spawned process's entry (cluster.distributed.rank_launcher.ProcessRankLauncher)."""
        cls(worker_id, cfg, rank, rendezvous, start=False).run()
        exit_now(0)
