"""PrefillRankFollower: rank 1..N-1 of a tensor-parallel prefill worker.

It holds its part of the model and of the KV cache (its KV heads) and runs every prefill pass rank 0
announces (prefill_worker.py; cluster/distributed/follower.py). When a pass ships KV, the follower
ships its own heads' part of it from its forward hooks, layer by layer as rank 0 does, over its own
pairs with the decode ranks (cluster/transport: the head mapping); rank 0 alone claims, commits and
talks to the decode worker.

What every follower rank does is cluster/distributed/follower_rank.py's.
"""

from __future__ import annotations

from cluster.distributed.follower_rank import FollowerRank
from cluster.distributed.step_messages import PrefillPass


class PrefillRankFollower(FollowerRank):
    role = "prefill"

    def handlers(self) -> dict:
        self._shipping = False
        self._hook_layers()
        return {PrefillPass: self._prefill}

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


def run_prefill_rank(rank: int, rendezvous, worker_id: str, cfg) -> None:
    """A spawned process's entry (cluster.distributed.rank_launcher.ProcessRankLauncher)."""
    PrefillRankFollower.run_rank(rank, rendezvous, worker_id, cfg)
