"""deploy.ray_runtime without a Ray instance: stopping within a budget, and the local GCS check."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time

import psutil
import pytest

from deploy.ray_runtime import gcs_gone, run_within


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
