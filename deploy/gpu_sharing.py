"""How the CUDA processes of this host share a GPU: through NVIDIA's Multi-Process Service (MPS) when
a control daemon is running, else time-sliced, one context at a time.

Why it matters here: a prefill and a decode worker on one GPU (`--gpus-per-worker 0.5`, the same-GPU
KV path) are two processes, so two CUDA contexts. Time-sliced, a prefill pass waits for the decode
process's time slice to end, and the first token's draw, which syncs on that pass, takes 10-13 ms on
the 1B shape as soon as anyone is decoding (2-3 ms when nobody is). Under MPS the two processes'
kernels run side by side: the same draw takes ~3 ms at 2-64 users, and decode steps are no slower
(loadtest/results/ttft_mps_h200.md). pdserve does not start the daemon: it is a host-wide service
that an operator runs (`nvidia-cuda-mps-control -d`); the serving log says which sharing the workers got.

The check asks the daemon itself, as any CUDA client with this environment would reach it: the
control tool, under the same CUDA_MPS_PIPE_DIRECTORY, asked for its server list, answers only if a
daemon runs there. (Looking for the daemon's files in that directory read "time-sliced" under a
running daemon on the H200, twice: the endpoint is not a plain file one can stat and trust.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping

MPS_CONTROL = "nvidia-cuda-mps-control"


def mps_running(env: Mapping[str, str] = os.environ, timeout_s: float = 5.0) -> bool:
    """True if an MPS control daemon answers CUDA clients with this environment."""
    tool = shutil.which(MPS_CONTROL, path=env.get("PATH"))
    if tool is None:  # no MPS on this host
        return False
    try:
        r = subprocess.run([tool], input="get_server_list\n", env=dict(env), capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def gpu_sharing(env: Mapping[str, str] = os.environ) -> str:
    """"mps" or "time-sliced": how processes with this environment share a GPU."""
    return "mps" if mps_running(env) else "time-sliced"
