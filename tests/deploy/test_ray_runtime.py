"""deploy.ray_runtime: stopping within a budget, the local GCS check, and the priority of a local Ray's
workers (the last test on the run's Ray; the others without one)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time

import psutil
import pytest
import ray

from deploy.config import ClusterConfig
from deploy.ray_runtime import RAY_WORKER_NICENESS_ENV, gcs_gone, init_ray, run_within


def test_run_within_waits_no_longer_than_its_budget():
    assert run_within(lambda: None, 5.0, "a quick stop")
    release = threading.Event()
    try:
        assert not run_within(lambda: release.wait(10), 0.05, "a hung stop")  # it goes on in the background
    finally:
        release.set()


def test_run_within_logs_a_failure_and_counts_it_as_done(caplog):
    def fail():
        raise RuntimeError("Ray said no")

    with caplog.at_level(logging.ERROR, logger="pdserve.launch"):
        assert run_within(fail, 5.0, "stopping the Ray actors")
    assert "stopping the Ray actors failed" in caplog.text and "Ray said no" in caplog.text


def test_gcs_gone_sees_a_live_gcs_but_not_a_killed_one(tmp_path):
    if any(p.name().startswith("gcs_server") for p in psutil.Process().children(recursive=True)):
        pytest.skip("this test process runs a local Ray")
    fake = tmp_path / "gcs_server"  # what Ray's GCS process is called
    shutil.copy("/bin/sleep", fake)
    proc = subprocess.Popen([str(fake), "60"])
    try:
        assert not gcs_gone()
        proc.kill()  # not reaped yet: listed as a zombie, as a killed GCS is until Ray's bookkeeping reaps it
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gcs_gone()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("address, operator_says, raylet_gets", [(None, None, "0"), (None, "5", "5"),
                                                                  ("10.0.0.1:6379", None, None)])
def test_a_local_ray_started_here_runs_its_workers_at_the_launchers_priority(monkeypatch, address, operator_says,
                                                                             raylet_gets):
    """Ray's default (worker_niceness 15) runs every actor below the API servers and any client on the
    host. A Ray this call starts gets 0 unless the operator set it; a cluster it joins keeps its own."""
    if operator_says is None:
        monkeypatch.delenv(RAY_WORKER_NICENESS_ENV, raising=False)
    else:
        monkeypatch.setenv(RAY_WORKER_NICENESS_ENV, operator_says)
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(env=os.environ.get(RAY_WORKER_NICENESS_ENV)))
    assert init_ray(ClusterConfig(model="/m", address=address))
    assert seen["env"] == raylet_gets


def test_the_runs_ray_workers_run_at_this_processs_priority(ray_session):
    """What the setting above does in Ray itself: on the run's Ray (tests/serving_harness.init_ray
    starts it with the same rule) an actor's process is as nice as the process that started Ray. Left
    at Ray's default they ran at nice 15, below the other test stream's nice 10 (tests/stream_scheduling.py)."""

    @ray_session.remote(num_cpus=0)
    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    probe = Probe.remote()
    try:
        assert ray_session.get(probe.niceness.remote(), timeout=60) == os.nice(0)
    finally:
        ray_session.kill(probe)
