"""deploy/gpu_sharing.py: MPS is seen where a CUDA client would find its daemon, and the serving log
says how a prefill and a decode worker on one GPU share it."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from pathlib import Path

from deploy import kv_transport_group
from deploy.gpu_sharing import gpu_sharing, mps_control_pipe

ROOT = Path(__file__).resolve().parents[2]


def test_the_daemons_control_pipe_means_mps(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert gpu_sharing(env) == "time-sliced" and mps_control_pipe(env) is None  # no daemon
    (tmp_path / "control").write_text("")  # a file of that name is not the daemon's pipe
    assert gpu_sharing(env) == "time-sliced"
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")  # older drivers' named pipe
    assert gpu_sharing(env) == "mps" and mps_control_pipe(env) == tmp_path / "control"


def test_a_listening_control_socket_means_mps_and_a_dead_ones_does_not(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon.bind(str(tmp_path / "control"))
    daemon.listen(4)
    try:
        assert gpu_sharing(env) == "mps" and mps_control_pipe(env) == tmp_path / "control"
    finally:
        daemon.close()
    assert (tmp_path / "control").exists() and gpu_sharing(env) == "time-sliced"  # the daemon is gone


def test_the_default_pipe_directory_is_cudas(monkeypatch, tmp_path):
    monkeypatch.setattr("deploy.gpu_sharing.MPS_DEFAULT_PIPE_DIRECTORY", str(tmp_path))
    os.mkfifo(tmp_path / "control")
    assert gpu_sharing({}) == "mps" and gpu_sharing({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "x")}) == "time-sliced"


def test_the_serving_log_says_how_the_workers_share_the_gpu(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    with caplog.at_level(logging.INFO, logger=kv_transport_group.log.name):
        kv_transport_group._say_gpu_sharing()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "time-sliced" in caplog.text and "nvidia-cuda-mps-control -d" in caplog.text
    caplog.clear()
    os.mkfifo(tmp_path / "control")
    with caplog.at_level(logging.INFO, logger=kv_transport_group.log.name):
        kv_transport_group._say_gpu_sharing()
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "through MPS" in caplog.text


def test_the_device_scripts_refuse_mps_in_a_dry_run(tmp_path):
    """MPS=1 needs CUDA: a dry run says so and writes nothing, rather than label time-sliced rows MPS."""
    for script in ("run_itl_h200.sh", "ttft_h200.sh", "run_prefix_cache.sh"):
        r = subprocess.run(["bash", str(ROOT / "scripts" / script), str(tmp_path / script)], cwd=ROOT,
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "MPS": "1", "DRY_RUN": "1"})
        assert r.returncode == 2 and "MPS=1 needs CUDA" in r.stderr, (script, r)
        assert not any((tmp_path / script).glob("*.json")), script
