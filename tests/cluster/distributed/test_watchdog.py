"""A tensor-parallel group goes down whole when one of its ranks dies, within the watchdog's peer
timeout, whatever the other ranks are doing (here: all-reducing in a loop, as serving ranks would): a
killed follower ends rank 0's process, a killed rank 0 ends the follower's; nothing waits in a collective.
Each survivor ends with the watchdog's exit code (Ray then restarts the worker as a new group)."""

import json
import multiprocessing as mp
import os
import signal
import time

import psutil
import pytest

import tp_procs
from cluster.distributed.watchdog import EXIT_CODE

pytestmark = pytest.mark.slow  # tensor-parallel ranks in spawned processes


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def group(tmp_path):
    info = tmp_path / "pids.json"
    leader = mp.get_context("spawn").Process(target=tp_procs.leader_main, args=(str(info), 3), daemon=False)
    leader.start()
    deadline = time.monotonic() + 120
    while not info.exists():
        assert time.monotonic() < deadline and leader.is_alive(), "the group did not form"
        time.sleep(0.05)
    time.sleep(0.3)
    pids = {int(r): p for r, p in json.loads(info.read_text()).items()}
    yield leader, pids
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    leader.join(5)
    if leader.is_alive():
        leader.kill()


def test_a_killed_follower_takes_the_group_down(group):
    leader, pids = group
    t0 = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    leader.join(20)
    took = time.monotonic() - t0
    assert leader.exitcode == EXIT_CODE, leader.exitcode
    deadline = time.monotonic() + 20
    while not _gone(pids[1]):
        assert time.monotonic() < deadline, "the other follower outlived its group"
        time.sleep(0.05)
    print(f"\ngroup down {took:.2f}s after a follower was killed")


def test_a_killed_rank0_takes_the_followers_down(group):
    leader, pids = group
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not (_gone(pids[1]) and _gone(pids[2])):
        assert time.monotonic() < deadline, "a follower outlived rank 0"
        time.sleep(0.05)
    print(f"\nfollowers down {time.monotonic() - t0:.2f}s after rank 0 was killed")
