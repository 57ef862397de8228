"""Where a rank runs: what each rank of a tensor-parallel group reports on arrival (TPGroup.info), so the
worker's stats show its ranks' placement (one node, one GPU each) and the tests check it."""

from __future__ import annotations

import os
import socket
import sys


def where_am_i() -> dict:
    """pid, host, CUDA_VISIBLE_DEVICES and, inside a Ray actor, its node, placement group and GPUs."""
    out = {"pid": os.getpid(), "host": socket.gethostname(),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if "ray" not in sys.modules:  # a Ray worker has imported it; anything else is not in Ray
        return out
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            out["node_id"] = ctx.get_node_id()
            out["placement_group"] = ctx.get_placement_group_id()
            out["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
            out["actor_id"] = ctx.get_actor_id()
    except Exception:  # noqa: BLE001 - not in Ray, or no runtime context: the rest says enough
        pass
    return out
