"""`pdserve serve` as a user runs it: a subprocess with its own local Ray, the real decode worker
(prefill on the decode worker: --prefill-workers 0), real HTTP, then SIGTERM shuts it all down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from deploy.cli import build_parser
from serve_process import start_serve

pytestmark = pytest.mark.cluster  # `pdserve serve` subprocesses, each with its own Ray


def test_serve_flags_and_help():
    args = build_parser().parse_args(["serve", "/m", "--prefill-workers", "2", "--decode-workers", "3", "--port", "9000",
                                      "--address", "auto", "--api-key", "k", "--config", "c.yaml"])
    assert (args.model_dir, args.prefill_workers, args.decode_workers, args.port, args.address, args.config) == \
        ("/m", 2, 3, 9000, "auto", "c.yaml")
    assert not hasattr(args, "host")  # not given: the YAML file or the default decides


def test_serve_bad_config_is_one_line(tmp_path):
    (tmp_path / "c.yaml").write_text("decode_workers: 0\n")
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--config", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: invalid configuration: decode_workers")
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(240)
def test_serve_answers_then_sigterm_stops_cleanly(demo_model_dir):
    pytest.importorskip("decode_worker.actor")
    proc, url, out = start_serve(demo_model_dir, "--prefill-workers", "0", "--decode-workers", "1",
                                 "--cpu-num-blocks", "128", env={"PDSERVE_API_KEY": "k"})
    try:
        assert url, "".join(out)
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                       json={"model": "demo", "prompt": "Once upon a time", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(out) + rest
        assert "pdserve: stopped" in rest
        # Every process of its own froze its startup heap once serving (cluster/worker/startup_heap.py):
        # the worker after its warm-up (its record), each API server, the launcher.
        log = "".join(out) + rest
        assert "'heap': {'frozen_objects'" in log and "api-0: startup heap frozen" in log, log
        assert "the launcher's startup heap frozen" in log, log
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(240)
def test_an_error_after_start_is_printed_before_the_stopped_line(demo_model_dir, ray_address):
    """Ray joined (the run's: so there is something to stop), then the port is taken: `error: ...`
    once, then `pdserve: stopped`, exit code 2."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", str(demo_model_dir), "--prefill-workers", "0",
                            "--device", "cpu", "--port", str(port), "--no-warmup"],
                           capture_output=True, text=True, timeout=200, env=dict(os.environ, RAY_ADDRESS=ray_address))
    finally:
        taken.close()
    lines = r.stderr.splitlines()
    errors = [i for i, ln in enumerate(lines) if ln.startswith("error: ")]
    stopped = [i for i, ln in enumerate(lines) if ln == "pdserve: stopped"]
    assert r.returncode == 2, r.stderr
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[errors[0]], r.stderr
    assert len(stopped) == 1 and errors[0] < stopped[0], r.stderr
