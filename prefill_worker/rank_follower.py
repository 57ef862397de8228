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
from cluster.distributed.rank_launcher import exit_now
from cluster.distributed.step_messages import PrefillPass
from cluster.transport.tp_payload import AgentHost
from cluster.worker_config import WorkerConfig
from cluster.worker_model import WorkerModel, join_group, rank_config

log = logging.getLogger(__name__)


class PrefillRankFollower:
    def __init__(self, worker_id: str, cfg: WorkerConfig, rank: int, rendezvous, *, start: bool = True, **options):
        self.worker_id, self.rank = worker_id, rank
        self.group = join_group(cfg, rank, rendezvous, **options)
        # This rank's part of the KV transport: it serves rank 0's calls from now on (its cache is
        # there before rank 0 can call: rank 0's own start-up waits for this rank's collectives).
        self.calls = AgentHost(self.group, lambda: self.kv_cache)
        self.wm = WorkerModel.load(rank_config(cfg, rank), self.group)
        self.follower = RankFollower(self.group, {PrefillPass: self._prefill})
        self._shipping = False
        self._hook_layers()
        self._thread = threading.Thread(target=self.run, name=f"tp-follower-{worker_id}-{rank}", daemon=True)
        if start:
            self._thread.start()

    @property
    def kv_cache(self):
        return self.wm.kv_cache


    def _hook_layers(self) -> None:
        """As PrefillWorker._hook_layers: layer i's K/V is written, so this rank's launches carrying it go."""
        def hook(i):
            def on_layer(module, args, output):
                if self._shipping:
                    self.calls.agent.layer_done(i)
            return on_layer
        for i, layer in enumerate(self.wm.model.layers):
            layer.register_forward_hook(hook(i))

    def _prefill(self, msg: PrefillPass) -> None:
        self._shipping = bool(msg.shipment)
        if self._shipping:
            if self.calls.agent is None:
                raise RuntimeError("a pass that ships KV before this rank's transport was attached")
            self.calls.agent.begin_pass(msg.shipment)
        try:
            self.wm.runner.execute(msg)
        finally:
            if self._shipping:
                self._shipping = False
                self.calls.agent.kv_done()  # every launch not issued yet, then this rank's part is sealed

    def run(self) -> str:
        why = self.follower.run()
        log.info("prefill rank %d of %s stopped: %s", self.rank, self.worker_id, why)
        self.calls.close()
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
    exit_now(0)
