"""PrefillRankFollower: rank 1..N-1 of a tensor-parallel prefill worker.

It holds its part of the model and of the KV cache (its KV heads) and runs every prefill pass rank 0
announces (prefill_worker.py; cluster/distributed/follower.py). When a pass ships KV, the follower
ships its own heads' part of it from its forward hooks, layer by layer as rank 0 does, over its own
pairs with the decode ranks (cluster/transport: the head mapping); rank 0 alone claims, commits and
talks to the decode worker.

As a Ray actor (deploy/ray_workers.py starts it from rank 0's actor, in the worker's bundle) the loop
runs on a thread of its own; `run_prefill_rank` runs it in a spawned process instead (tests, benchmarks).
"""

from __future__ import annotations

import logging
import threading

from cluster.distributed.follower import RankFollower
from cluster.distributed.step_messages import PrefillPass
from cluster.worker_config import WorkerConfig
from cluster.worker_model import WorkerModel, join_group, rank_config

log = logging.getLogger(__name__)


class PrefillRankFollower:
    def __init__(self, worker_id: str, cfg: WorkerConfig, rank: int, rendezvous, *, start: bool = True, **options):
        self.worker_id, self.rank = worker_id, rank
        self.group = join_group(cfg, rank, rendezvous, **options)
        self.wm = WorkerModel.load(rank_config(cfg, rank), self.group)
        self.follower = RankFollower(self.group, {PrefillPass: self._prefill})
        self.transport = None
        self._thread = threading.Thread(target=self.run, name=f"tp-follower-{worker_id}-{rank}", daemon=True)
        if start:
            self._thread.start()

    @property
    def kv_cache(self):
        return self.wm.kv_cache

    def _prefill(self, msg: PrefillPass) -> None:
        self.wm.runner.execute(msg)

    def run(self) -> str:
        why = self.follower.run()
        log.info("prefill rank %d of %s stopped: %s", self.rank, self.worker_id, why)
        if self.transport is not None:
            self.transport.close()
        self.group.close()
        return why

    def ready(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"rank": self.rank, "passes": self.follower.passes, "stopped": self.follower.stopped,
                "failed": self.group.failed}


def run_prefill_rank(rank: int, rendezvous, worker_id: str, cfg: WorkerConfig) -> None:
    """A spawned process's entry (cluster.distributed.rank_launcher.ProcessRankLauncher)."""
    PrefillRankFollower(worker_id, cfg, rank, rendezvous, start=False).run()
