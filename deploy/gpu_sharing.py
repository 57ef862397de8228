"""How the CUDA processes of this host share a GPU: through NVIDIA's Multi-Process Service (MPS) when
a control daemon is running, else time-sliced, one context at a time.

Why it matters here: a prefill and a decode worker on one GPU (`--gpus-per-worker 0.5`, the same-GPU
KV path) are two processes, so two CUDA contexts. Time-sliced, a prefill pass waits for the decode
process's time slice to end, and the first token's draw, which syncs on that pass, takes 10-13 ms on
the 1B shape as soon as anyone is decoding (1.4 ms when the GPU is otherwise idle). Under MPS the two
processes' kernels run side by side: the same draw takes ~3 ms at 2-64 users, and decode steps are no
slower (loadtest/results/ttft_mps_h200.json). pdserve does not start the daemon: it is a host-wide
service that an operator runs (`nvidia-cuda-mps-control -d`); the serving log says which sharing the
workers got.

The check: a CUDA client looks for the daemon's `control` endpoint in CUDA_MPS_PIPE_DIRECTORY (default
/tmp/nvidia-mps), so the same environment that Ray's workers inherit decides it here too. The daemon
makes it a UNIX socket (a named pipe in older drivers); a socket counts when it accepts a connection,
so one left by a daemon that died does not. (The first H200 run under a daemon read "time-sliced"
while only a pipe counted.)
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Mapping

MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_control_pipe(env: Mapping[str, str] = os.environ) -> Path | None:
    """The running MPS control daemon's endpoint that CUDA clients with this environment would use, or None."""
    pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIRECTORY) / "control"
    try:
        mode = pipe.stat().st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return pipe
    if not stat.S_ISSOCK(mode):
        return None
    # A socket left by a daemon that died refuses the connection: only a listening daemon counts.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(pipe))
        except OSError:
            return None
    return pipe


def gpu_sharing(env: Mapping[str, str] = os.environ) -> str:
    """"mps" or "time-sliced": how processes with this environment share a GPU."""
    return "mps" if mps_control_pipe(env) is not None else "time-sliced"
