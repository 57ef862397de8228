"""DecodeRankFollower: rank 1..N-1 of a tensor-parallel decode worker.

It holds its part of the model and of the KV cache (its KV heads), captures the same decode graphs as
rank 0 (decode_worker.py, through the same WorkerModel and BucketedGraphRunner.for_worker, so their
start-up collectives pair up), then runs every pass rank 0 announces: local prefills and warm-up passes
(PrefillPass) and decode steps (DecodeStep), in order (cluster/distributed/follower.py). No scheduler,
no token stream, no router: rank 0 has them.

What every follower rank does is cluster/distributed/follower_rank.py's. Its part of the worker's KV transport (a decode rank receives its own heads' KV from the prefill ranks
the head mapping names) is a payload agent (cluster/transport/tp_payload.py) that rank 0's transport
attaches and drives over the group's RPC: forming its links, posting a bundle's receives.
"""

from __future__ import annotations

from cluster.distributed.follower_rank import FollowerRank
from cluster.distributed.step_messages import DecodeStep, EagerDecode, PrefillPass
from cluster.kv.request_limits import served_max_model_len
from decode_worker.bucketed_graph_runner import BucketedGraphRunner


class DecodeRankFollower(FollowerRank):
    role = "decode"

    def handlers(self) -> dict:
        max_model_len = served_max_model_len(self.cfg.max_model_len, self.wm.arch.max_position_embeddings)
        self.graph_runner = BucketedGraphRunner.for_worker(self.wm, self.cfg, max_model_len, capture_progress=False)
        return {PrefillPass: self.wm.runner.execute, EagerDecode: self.wm.runner.execute,
                DecodeStep: self.graph_runner.replay_step}


def run_decode_rank(rank: int, rendezvous, worker_id: str, cfg) -> None:
    """A spawned process's entry (cluster.distributed.rank_launcher.ProcessRankLauncher)."""
    DecodeRankFollower.run_rank(rank, rendezvous, worker_id, cfg)
