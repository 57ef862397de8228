"""RayRankLauncher: how the rank-0 actor of a tensor-parallel worker starts its followers in a served
cluster: Ray actors in the worker's own placement-group bundle (one node: a bundle never spans nodes;
one GPU each), created from inside the rank-0 actor, which owns them, so that they die with it (Ray's
ownership: a dead owner's actors are killed). A Ray restart of rank 0 reruns its constructor, which
launches new followers into the same bundle once the old ones have released it.

It is passed to the rank-0 actor's constructor (cluster/distributed/rank_launcher.RankLauncher), as a
picklable description: the follower class, the worker's id and config, the bundle and its resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RayRankLauncher:
    follower_cls: Any  # decode_worker.rank_follower.DecodeRankFollower / prefill_worker.rank_follower.PrefillRankFollower
    worker_id: str
    cfg: Any  # the worker's WorkerConfig
    placement_group: Any
    bundle_index: int
    num_cpus: float
    num_gpus: float

    def launch(self, rendezvous) -> list:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = self.follower_cls if hasattr(self.follower_cls, "options") else ray.remote(self.follower_cls)
        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=self.bundle_index)
        # No restarts of a follower alone: a group that lost a rank goes down whole (its watchdogs).
        return [cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=strategy,
                            max_restarts=0, max_task_retries=0).remote(self.worker_id, self.cfg, rank, rendezvous)
                for rank in range(1, rendezvous.size)]
