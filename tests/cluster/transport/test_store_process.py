"""The rendezvous store's own process (cluster/transport/store_process.py): it serves like the in-process
store, a fill past its cap fails there and never here, its warden undoes a fill and never touches what
a rendezvous in progress uses, it dies with its parent, and its death is reported."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
import torch
import torch.distributed as dist

from cluster.errors import PdserveError
from cluster.transport.authenticated_store import AuthenticatedStore
from cluster.transport.base import KVSend
from cluster.transport.factory import TransportSpec, create_transport
from cluster.transport.store_process import StoreProcess
from cluster.wire.messages import Reservation

pytestmark = pytest.mark.slow  # store child processes, each importing torch

SECRET = b"p" * 32
MiB = 1 << 20
# The child's start (its import of torch) within 4 minutes, not wait_ready's 60 s: this module runs in the
# test run's other stream (nice 10: tests/stream_scheduling.py), which a busy machine may leave a tenth of a core.
START_S = 240.0


def _start(ns: str = "ns", **kw) -> StoreProcess:
    sp = StoreProcess.start("127.0.0.1", 0, secret=SECRET, namespace=ns, **kw)
    sp.wait_ready(START_S)
    return sp


def _wait(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_store_serves_from_its_own_process_without_the_secret_in_argv():
    sp = _start()
    try:
        # Forked from this process's process template (cluster/process/), named after its module.
        child = psutil.Process(sp.pid)
        assert sp.pid != os.getpid() and child.parent().ppid() == os.getpid() and child.name() == "store_process"
        assert SECRET.hex() not in " ".join(psutil.Process(sp.pid).cmdline())
        listening = {c.laddr.port: c.laddr.ip for c in psutil.Process(sp.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening[sp.port] == "127.0.0.1"
        st = AuthenticatedStore(sp.client(), SECRET)
        st.set("ns/ctl/d", b"endpoint")
        assert AuthenticatedStore(sp.client(), SECRET).get("ns/ctl/d") == b"endpoint"
        start = sp.startup
        print(f"\nstore process start: {start['cpu_s']} s CPU (child), {start['wall_s']:.3f} s wall to its port")
        assert start["cpu_s"] > 0 and start["data_limit"] > 1024 * MiB
    finally:
        sp.stop()
    assert sp.exited() == 0 and not psutil.pid_exists(sp.pid)


def test_a_port_in_use_is_a_clear_error():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    sp = StoreProcess.start("127.0.0.1", busy.getsockname()[1], secret=SECRET, namespace="ns")
    try:
        with pytest.raises(PdserveError, match="did not start: OSError.*Address already in use"):
            sp.wait_ready(START_S)
    finally:
        sp.stop()
        busy.close()
    with pytest.raises(PdserveError, match="internal address"):
        StoreProcess.start("0.0.0.0", 0, secret=SECRET, namespace="ns").wait_ready(START_S)


def test_a_fill_past_the_cap_fails_in_the_child_and_never_here():
    """No warden: 8 MiB values until the 64 MiB cap refuses one. The writer's connection is closed,
    the child stays within its limit and keeps serving, and this process did not grow."""
    sp = _start(memory_limit_mib=64, sweep_s=0)
    try:
        me = psutil.Process()
        before = me.memory_info().rss
        rogue, refused = sp.client(), None
        for i in range(32):
            try:
                rogue.set(f"fill/{i}", b"x" * (8 * MiB))
                rogue.num_keys()
            except Exception:  # noqa: BLE001 (the store dropped the connection)
                refused = i
                break
        child = psutil.Process(sp.pid)
        data = int(next(line.split()[1] for line in open(f"/proc/{sp.pid}/status") if line.startswith("VmData:")))
        print(f"\nrefused at value {refused}; child VmData {data >> 10} MiB (limit {sp.startup['data_limit'] >> 20} MiB),"
              f" this process grew {(me.memory_info().rss - before) / MiB:.1f} MiB")
        assert refused is not None and refused < 9  # 64 MiB: at most 8 values fit
        assert sp.exited() is None and data * 1024 <= sp.startup["data_limit"]
        assert me.memory_info().rss - before < 32 * MiB
        c = sp.client()
        for k in c.list_keys():
            c.delete_key(k)
        c.set("after", b"y" * (8 * MiB))  # the space is the store's again
        assert len(c.get("after")) == 8 * MiB and child.is_running()
    finally:
        sp.stop()


def test_the_warden_undoes_a_fill_and_a_flood():
    ns = "pdserve-fill"
    sp = _start(ns, sweep_s=0.05)
    try:
        rss_before = psutil.Process(sp.pid).memory_info().rss
        sealed = AuthenticatedStore(sp.client(), SECRET)
        sealed.set(f"{ns}/ctl/decode-0", b"the real endpoint")
        sealed.add(f"{ns}/inc/decode-0", 1)
        rogue = sp.client()
        for i in range(64):
            rogue.set(f"{ns}/x/prefill-0/decode-0.1/{i}" if i % 2 else f"fill/{i}", b"x" * (8 * MiB))
        for i in range(20000):
            rogue.set(f"flood/{i}", b"1")
        rogue.num_keys()
        legit = {f"{ns}/ctl/decode-0", f"{ns}/inc/decode-0"}

        def clean():
            keys = set(sp.client().list_keys())
            return keys - legit == {f"{ns}/x/prefill-0/decode-0.1/{i}" for i in range(1, 64, 2)}
        assert _wait(clean, 120)  # 20k deletes by the child's warden: seconds of CPU, a minute or more at nice 10
        c = sp.client()
        assert all(c.get(f"{ns}/x/prefill-0/decode-0.1/{i}") == b"" for i in range(1, 64, 2))
        assert sealed.get(f"{ns}/ctl/decode-0") == b"the real endpoint" and sealed.add(f"{ns}/inc/decode-0", 1) == 2
        assert _wait(lambda: sp.stats().get("deleted", 0) >= 20032)
        stats = sp.stats()
        assert stats["tombstoned"] >= 32 and stats["vm_data"] <= sp.startup["data_limit"]
        # The deleted junk's memory goes back to the system (malloc_trim after a sweep that removed
        # something); a tombstoned key keeps its buffer (TCPStore reuses a value's buffer when it is
        # overwritten: only a delete frees it), here 32 x 8 MiB.
        assert _wait(lambda: psutil.Process(sp.pid).memory_info().rss < rss_before + (32 * 8 + 64) * MiB)
        print(f"\nwarden: {stats}; the store process's RSS {rss_before / MiB:.0f} MiB before the fill, "
              f"{psutil.Process(sp.pid).memory_info().rss / MiB:.0f} MiB after")
    finally:
        sp.stop()


_ORPHAN = """
import sys, time
from cluster.transport.store_process import StoreProcess
sp = StoreProcess.start("127.0.0.1", 0, secret=b"p" * 32, namespace="ns")
sp.wait_ready(240)  # (START_S: at nice 10, like this module)
print(sp.pid, flush=True)
time.sleep(600)
"""


def test_the_store_dies_with_its_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, env=os.environ)
    child = int(launcher.stdout.readline())
    assert psutil.pid_exists(child)
    launcher.kill()  # SIGKILL: nothing of the launcher's runs after it
    launcher.wait()
    assert _wait(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)


def test_a_dead_store_is_reported(caplog):
    sp = _start()
    codes = []
    sp.on_exit = codes.append
    with caplog.at_level(logging.ERROR, logger="pdserve.store"):
        os.kill(sp.pid, signal.SIGKILL)
        assert _wait(lambda: codes == [-signal.SIGKILL])
    assert sp.exited() == -signal.SIGKILL
    assert "the KV rendezvous store's process" in caplog.text and "exited with code -9" in caplog.text
    sp.stop()  # (idempotent on a dead child)


# -- the warden at a high rate while rendezvous go on ----------------------------------------------------
BS = 4


def _land(td, tp, seq: int, src, dst, peer: str) -> None:
    res = Reservation(f"r{seq}", "d", (5 + seq % 3,), seq)
    td.expect(res, peer)
    sh = tp.begin([KVSend(res, BS, (seq % 3,))])
    sh.commit({res.request_id: 7})
    deadline, got = time.monotonic() + 20, []
    while not got and time.monotonic() < deadline:
        got = td.poll_arrivals()
        time.sleep(0.002)
    assert len(got) == 1 and got[0].error is None and got[0].header.first_token == 7, got
    assert torch.equal(dst[:, :, 5 + seq % 3], src[:, :, seq % 3])


def test_rendezvous_go_on_while_the_warden_sweeps_at_a_high_rate():
    """The warden sweeps every 5 ms while, in its namespace: transports start and stop (incarnation
    counters, heartbeats, control entries, verdicts), 40 transfers are claimed and land, gloo pairs form
    and move bytes 8 times (c10d's rendezvous keys), and an attacker writes junk into the same shapes.
    Everything lands exactly; the junk is removed."""
    ns = f"pdserve-{uuid.uuid4().hex[:8]}"
    sp = _start(ns, sweep_s=0.005)
    stop = threading.Event()

    def attack():
        rogue, i = sp.client(), 0
        while not stop.is_set():
            rogue.set(f"{ns}/x/p/d.1/{10**6 + i}", b"P")
            rogue.set(f"{ns}/pg/p.1/d.1/g{i}/L0/junk", b"10.0.0.9:1")
            rogue.set(f"junk/{i}", b"x" * 4096)
            rogue.num_keys()
            i += 1
            time.sleep(0.002)
    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    sweeps_before = sp.stats().get("sweeps", 0)  # {} before its first report
    try:
        spec = TransportSpec("local", store_host="127.0.0.1", store_port=sp.port, secret=SECRET, namespace=ns,
                             heartbeat_s=0.05)
        g = torch.Generator().manual_seed(0)
        src = torch.randn(2, 2, 32, BS, 2, 8, generator=g)
        dst = torch.zeros(2, 2, 32, BS, 2, 8)
        td = create_transport(spec, dst, "d", "decode")
        seq = 0
        # One prefill worker restarted three times: incarnation counters, hellos, verdicts, pairs. (Each
        # incarnation's pair is generation 0 again: before the "pair broken" note named both incarnations,
        # a restarted one read its predecessor's note and broke its new pair, failing a transfer.)
        for life in range(4):
            tp = create_transport(spec, src, "p", "prefill")
            tp.connect(["d"])
            for _ in range(10):
                _land(td, tp, seq, src, dst, "p")
                seq += 1
            tp.close()
        td.close()
        for gen in range(8):  # gloo pairs through the sealed store, as torch_dist.py forms them
            out = {}

            def rank(r):
                st = AuthenticatedStore(sp.client(), SECRET).prefixed(f"{ns}/pg/p.1/d.1/g{gen}/L0/")
                pg = dist.ProcessGroupGloo(st, r, 2, datetime.timedelta(seconds=30))
                t = torch.arange(4.0) + gen if r == 0 else torch.zeros(4)
                (pg.send if r == 0 else pg.recv)([t], 1 - r, 0).wait()
                out[r] = (t, st)
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            [t.start() for t in threads]
            [t.join(60) for t in threads]
            assert torch.equal(out[1][0], torch.arange(4.0) + gen)
    finally:
        stop.set()
        attacker.join(10)
    try:
        assert _wait(lambda: not any(k.startswith("junk/") for k in sp.client().list_keys()))
        stats = sp.stats()
        print(f"\nwarden while 40 transfers and 8 gloo pairs went on: {stats}")
        # At least one whole sweep inside the transfers and pair formations (the count is the warden's
        # pace, not asserted: a loaded machine sweeps less often).
        assert stats["sweeps"] >= sweeps_before + 2 and stats["deleted"] > 0 and stats["tombstoned"] > 0 and stats["errors"] == 0
    finally:
        sp.stop()
