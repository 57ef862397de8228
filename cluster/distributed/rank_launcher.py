"""How rank 0 of a tensor-parallel worker starts its followers: a RankLauncher's `launch(rendezvous)`
starts ranks 1..N-1 (each joins the group with the rendezvous) and returns at once, with whatever keeps
them alive.

- In a served cluster: Ray actors in the worker's own placement-group bundle (deploy/ray_workers.py,
  `RayRankLauncher`), created by rank 0's actor, which owns them: they die with it.
- In tests, benchmarks and the in-process engine: `ProcessRankLauncher`, spawned processes
  (torch.multiprocessing, "spawn": each imports torch afresh), daemonic: they die with this process.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Protocol


def exit_now(code: int = 0) -> None:
    """The end of a spawned follower, once its group closed. NOTE: os._exit, not a return: the
    interpreter's teardown would destroy the KV links' gloo/NCCL groups while their threads still run,
    which aborts the process ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class RankLauncher(Protocol):
    def launch(self, rendezvous) -> Any:
        """Starts ranks 1..rendezvous.size-1; returns at once."""
        ...


class ProcessRankLauncher:
    """Each follower runs `target(rank, rendezvous, *args)` in a spawned process (target: a module-level
    function, pickled by name: e.g. decode_worker.rank_follower.run_decode_rank)."""

    def __init__(self, target: Callable, *args):
        self.target, self.args = target, args
        self.processes: list = []

    def launch(self, rendezvous) -> list:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        for rank in range(1, rendezvous.size):
            p = ctx.Process(target=self.target, args=(rank, rendezvous, *self.args), daemon=True,
                            name=f"tp-rank-{rank}")
            p.start()
            self.processes.append(p)
        return self.processes

    def join(self, timeout_s: float = 30.0) -> list[int | None]:
        """Waits for the followers to exit (after the group closed); their exit codes."""
        for p in self.processes:
            p.join(timeout_s)
        return [p.exitcode for p in self.processes]

    def kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
