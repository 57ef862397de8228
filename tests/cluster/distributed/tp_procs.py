"""Processes of the tensor-parallel group tests (spawned: each imports this module afresh)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def _spin(group) -> None:
    """All-reduces forever, as a serving rank's passes would; a failed collective breaks the group."""
    x = torch.ones(8)
    while True:
        try:
            group.comm.all_reduce(x.clone())
        except Exception as e:  # noqa: BLE001
            group.fail(f"collective failed: {e}")
            time.sleep(60)  # fail() ends the process; never reached
        time.sleep(0.005)


def leader_main(info_path: str, size: int) -> None:
    from cluster.distributed.rank_launcher import ProcessRankLauncher
    from cluster.distributed.tp_group import TPGroup

    launcher = ProcessRankLauncher(follower_main)
    g = TPGroup.leader(size, "cpu", torch.float32, launcher.launch, heartbeat_s=0.2, peer_timeout_s=2.0)
    Path(info_path).write_text(json.dumps({str(r): i["pid"] for r, i in g.info.items()}))
    _spin(g)


def follower_main(rank: int, rendezvous) -> None:
    from cluster.distributed.tp_group import TPGroup

    _spin(TPGroup.follower(rendezvous, rank, "cpu", torch.float32))
