"""`pdserve serve` as a user runs it, for the tests whose subject is the command itself: a subprocess
on CPU at a free port, serving as "demo", with its own local Ray (RAY_ADDRESS empty) or joining the
run's (`ray_address`: tests/conftest.py's fixture)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time


def start_serve(model_dir, *flags: str, env: dict | None = None, timeout_s: float = 180,
                new_session: bool = False, ray_address: str = "") -> tuple[subprocess.Popen, str | None, list[str]]:
    """Starts `pdserve serve MODEL_DIR --port 0 --device cpu --no-use-cuda-graph --served-model-name demo
    FLAGS` (joining the Ray at `ray_address`, else starting its own) and reads its output until it
    prints the URL it serves at; returns (process, base URL or None if it ended or `timeout_s` passed
    first, the output lines read). The caller stops it."""
    cmd = [sys.executable, "-m", "deploy.cli", "serve", str(model_dir), "--port", "0", "--device", "cpu",
           "--no-use-cuda-graph", "--served-model-name", "demo", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_ADDRESS=ray_address, **(env or {})), start_new_session=new_session)
    url, out = None, []
    deadline = time.monotonic() + timeout_s
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        m = re.search(r"serving demo at (http://\S+)/v1", line)
        url = m.group(1) if m else None
    return proc, url, out
