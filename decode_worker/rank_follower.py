"""DecodeRankFollower: rank 1..N-1 of a tensor-parallel decode worker.

It holds its part of the model and of the KV cache (its KV heads), captures the same decode graphs as
rank 0 (decode_worker.py, through the same WorkerModel and BucketedGraphRunner.for_worker, so their
start-up collectives pair up), then runs every pass rank 0 announces: local prefills and warm-up passes
(PrefillPass) and decode steps (DecodeStep), in order (cluster/distributed/follower.py). No scheduler,
no token stream, no router: rank 0 has them.

As a Ray actor (deploy/ray_workers.py starts it from rank 0's actor, in the worker's bundle) the loop
runs on a thread of its own; `run_decode_rank` runs it in a spawned process instead (tests, benchmarks).
Its part of the worker's KV transport (a decode rank receives its own heads' KV from the prefill ranks
the head mapping names) is a payload agent (cluster/transport/tp_payload.py) that rank 0's transport
attaches and drives over the group's RPC: forming its links, posting a bundle's receives.
"""

from __future__ import annotations

import logging
import threading

from cluster.distributed.follower import RankFollower
from cluster.distributed.rank_launcher import exit_now
from cluster.distributed.step_messages import DecodeStep, EagerDecode, PrefillPass
from cluster.request_limits import served_max_model_len
from cluster.transport.tp_payload import AgentHost
from cluster.worker_config import WorkerConfig
from cluster.worker_model import WorkerModel, join_group, rank_config
from decode_worker.bucketed_graph_runner import BucketedGraphRunner

log = logging.getLogger(__name__)


class DecodeRankFollower:
    def __init__(self, worker_id: str, cfg: WorkerConfig, rank: int, rendezvous, *, start: bool = True, **options):
        self.worker_id, self.rank = worker_id, rank
        self.group = join_group(cfg, rank, rendezvous, **options)
        # This rank's part of the KV transport: it serves rank 0's calls from now on (its cache is
        # there before rank 0 can call: rank 0's own start-up waits for this rank's collectives).
        self.calls = AgentHost(self.group, lambda: self.kv_cache)
        cfg = rank_config(cfg, rank)
        self.wm = WorkerModel.load(cfg, self.group)
        max_model_len = served_max_model_len(cfg.max_model_len, self.wm.arch.max_position_embeddings)
        self.graph_runner = BucketedGraphRunner.for_worker(self.wm, cfg, max_model_len, capture_progress=False)
        self.follower = RankFollower(self.group, {PrefillPass: self.wm.runner.execute, EagerDecode: self.wm.runner.execute,
                                                  DecodeStep: self.graph_runner.replay_step})
        self._thread = threading.Thread(target=self.run, name=f"tp-follower-{worker_id}-{rank}", daemon=True)
        if start:
            self._thread.start()

    @property
    def kv_cache(self):
        return self.wm.kv_cache

    def run(self) -> str:
        why = self.follower.run()
        log.info("decode rank %d of %s stopped: %s", self.rank, self.worker_id, why)
        self.calls.close()
        self.group.close()
        return why

    def ready(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"rank": self.rank, "passes": self.follower.passes, "stopped": self.follower.stopped,
                "failed": self.group.failed}


def run_decode_rank(rank: int, rendezvous, worker_id: str, cfg: WorkerConfig) -> None:
    """A spawned process's entry (cluster.distributed.rank_launcher.ProcessRankLauncher)."""
    DecodeRankFollower(worker_id, cfg, rank, rendezvous, start=False).run()
    exit_now(0)
