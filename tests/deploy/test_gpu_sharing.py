"""deploy/gpu_sharing.py: MPS is seen when a daemon answers under the environment the workers get, and
the serving log says how a prefill and a decode worker on one GPU share it."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from deploy import kv_transport_group
from deploy.gpu_sharing import gpu_sharing, mps_running

ROOT = Path(__file__).resolve().parents[2]


def _control_tool(bin_dir: Path, pipe_dir: Path) -> None:
    """A stand-in for nvidia-cuda-mps-control: as the real one, it answers `get_server_list` only if a
    daemon runs in CUDA_MPS_PIPE_DIRECTORY (here: a file `daemon` marks it), else exits 1."""
    tool = bin_dir / "nvidia-cuda-mps-control"
    tool.write_text("#!/bin/sh\nread cmd\n[ \"$cmd\" = get_server_list ] || exit 3\n"
                    "[ -e \"${CUDA_MPS_PIPE_DIRECTORY:-/nonexistent}/daemon\" ] || { echo 'Cannot find MPS control daemon' >&2; exit 1; }\n"
                    "echo 4242\n")
    tool.chmod(0o755)


def test_a_daemon_that_answers_means_mps(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    _control_tool(tmp_path, pipe)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    assert not mps_running(env) and gpu_sharing(env) == "time-sliced"  # the tool, but no daemon
    (pipe / "daemon").touch()
    assert mps_running(env) and gpu_sharing(env) == "mps"
    # Another pipe directory is another daemon: the workers' environment decides.
    assert gpu_sharing({**env, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == "time-sliced"


def test_no_control_tool_means_time_sliced(tmp_path):
    assert gpu_sharing({"PATH": str(tmp_path)}) == "time-sliced"


def test_a_tool_that_hangs_is_time_sliced_in_time(tmp_path):
    tool = tmp_path / "nvidia-cuda-mps-control"
    tool.write_text("#!/bin/sh\nexec sleep 30\n")
    tool.chmod(0o755)
    assert not mps_running({"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout_s=0.5)


def test_the_serving_log_says_how_the_workers_share_the_gpu(monkeypatch, tmp_path, caplog):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    _control_tool(tmp_path, pipe)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    with caplog.at_level(logging.INFO, logger=kv_transport_group.log.name):
        kv_transport_group._say_gpu_sharing()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "time-sliced" in caplog.text and "nvidia-cuda-mps-control -d" in caplog.text
    caplog.clear()
    (pipe / "daemon").touch()
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
