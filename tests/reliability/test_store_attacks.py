"""The KV rendezvous store is no trust root (issue 37 item 1): a client of the real TCPStore without the
cluster's secret rewrites what the transports read from it (a decode worker's control endpoint, its
heartbeat, a transfer's claim, an incarnation counter, a pair's payload rendezvous). Each forgery is
rejected before use: the transfer still lands exactly in the reserved blocks, nothing reaches the
attacker, and nothing is cancelled. (Transports: the "local" payload, one process, over a real TCPStore
and real ZMQ sockets; the store's wrapper is the one every worker uses: rendezvous_store.store_factory.)"""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import msgspec
import pytest
import torch
import torch.distributed as dist
import zmq

from cluster.wire.messages import Reservation
from cluster.transport.authenticated_store import AuthenticatedStore
from cluster.transport.base import KVSend
from cluster.transport.factory import TransportSpec, create_transport
from cluster.transport.pair import CANCEL, CLAIM, claim_key
from cluster.transport.rendezvous_store import start_store

SECRET = b"s" * 32
BS = 4


@pytest.fixture(scope="module")
def store():
    s = start_store("127.0.0.1", 0)
    yield s


_made: list = []


@pytest.fixture(autouse=True)
def _closed_after_each_test():
    """Every transport a test makes is closed when it ends, passed or failed. One left open by a failed
    test beat and watched on against the module's store after it was gone, logging a traceback each
    round; on Python 3.11 each traceback ran ast.parse (its underlines) and raced the AST-walking tests
    in the same process (python_source.py says how): one failure became seven."""
    yield
    while _made:
        _made.pop().close()


def _create(spec, kv, worker_id: str, role: str):
    t = create_transport(spec, kv, worker_id, role)
    _made.append(t)
    return t


def _rogue(store) -> dist.TCPStore:
    """A client of the store that does not hold the secret."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10), use_libuv=True)


def _transports(store, **kw):
    spec = TransportSpec("local", store_host="127.0.0.1", store_port=store.port, secret=SECRET,
                         namespace=f"atk-{uuid.uuid4().hex[:8]}", heartbeat_s=0.05, **kw)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 2, 32, BS, 2, 8, generator=g)
    src[:, :, 0] = 0
    dst = torch.zeros(2, 2, 32, BS, 2, 8)
    td = _create(spec, dst, "d", "decode")
    return spec, src, dst, td, lambda: _create(spec, src, "p", "prefill")


def _land(td, tp, seq: int, src, dst, blocks=(5, 6), srcb=(3,)):
    """One transfer, which must land exactly in its reserved blocks."""
    res = Reservation(f"r{seq}", "d", blocks, seq)
    td.expect(res, "p")
    sh = tp.begin([KVSend(res, BS, srcb)])
    sh.commit({res.request_id: 7})
    deadline, got = time.monotonic() + 10, []
    while not got and time.monotonic() < deadline:
        got = td.poll_arrivals()
        time.sleep(0.002)
    assert len(got) == 1 and got[0].error is None and got[0].header.first_token == 7, got
    assert torch.equal(dst[:, :, blocks[0]], src[:, :, srcb[0]])
    return sh


def test_a_forged_control_endpoint_redirects_nothing(store):
    spec, src, dst, td, prefill = _transports(store)
    ns, rogue = spec.namespace, _rogue(store)
    sink = zmq.Context.instance().socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    forged = msgspec.msgpack.encode({"endpoint": f"tcp://127.0.0.1:{port}", "incarnation": 99,
                                     "layout": {}, "numerics": None})
    rogue.set(f"{ns}/ctl/d", forged)  # the decode worker's entry, replaced (unsealed, then a sealed-looking one)
    rogue.set(f"{ns}/ctl/d", b"\0" * 16 + forged)
    tp = prefill()
    tp.connect(["d"])  # waits out the forgery: the decode worker puts its entry back (heartbeat thread)
    _land(td, tp, 0, src, dst)
    assert sink.poll(200) == 0  # not one control frame reached the attacker
    assert td.metrics()["failures"] == 0
    sink.close(linger=0)
    tp.close(), td.close()


def test_a_forged_heartbeat_neither_kills_nor_revives_a_peer(store):
    # A forged close or restart would count at once, whatever peer_timeout_s; silence needs it to pass
    # with nothing but forgeries read (test_link.py): 2 s, not a CPU stall on a loaded 2-core runner.
    spec, src, dst, td, prefill = _transports(store, peer_timeout_s=2.0)
    ns, rogue = spec.namespace, _rogue(store)
    tp = prefill()
    tp.connect(["d"])
    time.sleep(0.2)
    old = rogue.get(f"{ns}/hb/d")  # the decode worker's own record, a few beats ago
    time.sleep(0.2)
    fakes = (b"-1000000000",  # "shut down", as the old raw counter would have said
             msgspec.msgpack.encode([td.incarnation + 1, 0]),  # "restarted"
             b"\0" * 16 + b"x",
             old)  # a replay: valid, but older than what the prefill took already
    for seq, fake in enumerate(fakes):
        rogue.set(f"{ns}/hb/d", fake)
        tp.sender.watch_outgoing(tp.link.store())  # what the watch thread runs: the peer must stay alive
        tp.link.check_incarnation(tp.link.store(), "d", td.incarnation)  # and not restarted
        _land(td, tp, seq, src, dst, blocks=(5 + 2 * seq, 6 + 2 * seq), srcb=(3 + seq,))
    assert "d" not in tp.metrics()["dead_peers"] and tp.metrics()["failures"] == 0
    tp.close(), td.close()


def test_forged_claims_neither_win_nor_cancel_a_transfer(store):
    spec, src, dst, td, prefill = _transports(store, expect_timeout_s=1.0)
    ns, rogue = spec.namespace, _rogue(store)
    tp = prefill()
    tp.connect(["d"])
    # The attacker takes the claim keys of the next transfers first: as a CANCEL (the prefill would give
    # up) and as a CLAIM (the prefill would call it claimed twice).
    for seq, fake in ((0, CANCEL), (1, CLAIM), (2, b"\0" * 16 + CANCEL)):
        rogue.set(claim_key(ns, "p", "d", td.incarnation, seq), fake)
        _land(td, tp, seq, src, dst, blocks=(5 + 2 * seq, 6 + 2 * seq), srcb=(3 + seq,))
    # A forged CLAIM does not hold off the decode side's cancel either: an expected transfer that never
    # comes is cancelled at expect_timeout_s (its blocks back), not kept transfer_timeout_s longer.
    rogue.set(claim_key(ns, "p", "d", td.incarnation, 3), CLAIM)
    t0 = time.monotonic()
    td.expect(Reservation("never", "d", (20,), 3), "p")
    got = []
    while not got and time.monotonic() - t0 < 10:
        got = td.poll_arrivals()
        time.sleep(0.01)
    assert got and "expect_timeout_s" in got[0].error and time.monotonic() - t0 < 5, got
    assert "p" not in td.metrics()["dead_peers"]
    tp.close(), td.close()


def test_a_counter_set_back_never_reuses_an_incarnation(store):
    spec, src, dst, td, prefill = _transports(store)
    ns, rogue = spec.namespace, _rogue(store)
    first = td.incarnation
    td.close()
    rogue.add(f"{ns}/inc/d", -100)  # set back below the closed incarnation
    dst2 = torch.zeros_like(dst)
    td2 = _create(spec, dst2, "d", "decode")
    assert td2.incarnation > first
    tp = prefill()
    tp.connect(["d"])
    _land(td2, tp, 0, src, dst2)
    tp.close(), td2.close()


class _RacingStore:
    """The raw store as seen while an attacker races the real writers: the first read of every key
    returns the attacker's value (an address of its own), later reads the real one."""

    def __init__(self, raw):
        self.raw, self.forged, self._lock = raw, set(), threading.Lock()
        self.timeout = raw.timeout

    def get(self, key):
        with self._lock:
            first = key not in self.forged
            self.forged.add(key)
        if first:
            self.raw.get(key)  # (waits until the real writer wrote it: then the attacker overwrote it)
            return b"\0" * 16 + b"tcp://203.0.113.9:1"
        return self.raw.get(key)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def test_a_forged_payload_rendezvous_is_skipped(store):
    """gloo's pair rendezvous over the sealed store: every value the peer reads is first a forgery
    (a racing attacker's address); the group forms with the real peer and moves the real bytes."""
    raw = _rogue(store)
    prefix = f"pg-{uuid.uuid4().hex[:8]}/"
    out = {}

    def rank(r):
        st = AuthenticatedStore(_RacingStore(raw if r == 0 else _rogue(store)), SECRET).prefixed(prefix)
        pg = dist.ProcessGroupGloo(st, r, 2, datetime.timedelta(seconds=20))
        t = torch.arange(4.0) if r == 0 else torch.zeros(4)
        (pg.send if r == 0 else pg.recv)([t], 1 - r, 0).wait()
        out[r] = (t, st.rejected)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert torch.equal(out[1][0], torch.arange(4.0))
    assert out[0][1] + out[1][1] > 0  # forgeries were read, and rejected before use


def test_the_store_rejects_values_moved_to_another_key(store):
    st = AuthenticatedStore(_rogue(store), SECRET)
    st.set("a/ctl/d", b"endpoint")
    raw = _rogue(store)
    raw.set("b/ctl/d", raw.get("a/ctl/d"))  # a valid value, copied under another key
    assert st.read("a/ctl/d") == b"endpoint" and st.read("b/ctl/d") is None
    assert not st.check(["b/ctl/d"])


def test_a_pair_re_forming_never_stops_the_heartbeat(store, monkeypatch):
    """Re-forming a broken pair blocks in its rendezvous (up to transfer_timeout_s): it runs on the
    watch thread, and the prefill side's beats go on meanwhile (on the heartbeat thread they stopped,
    and the decode side took the prefill worker for dead: "silent for 16.9s")."""
    from cluster.transport.sender_side import SenderSide

    blocked, release = threading.Event(), threading.Event()

    def stuck_watch(self, store):  # a re-formation waiting for its peer
        blocked.set()
        release.wait(30)
    monkeypatch.setattr(SenderSide, "watch_pairs", stuck_watch)
    spec, src, dst, td, make_tp = _transports(store)
    tp = make_tp()
    try:
        assert blocked.wait(10)
        s = td.link.store()
        first = td.link.heartbeat_of(s, "p")
        deadline = time.monotonic() + 10
        while td.link.heartbeat_of(s, "p") < first + 5:  # beats every 0.05 s while the watch is stuck
            assert time.monotonic() < deadline, "the prefill side stopped beating while a pair re-formed"
            time.sleep(0.05)
        td.link.check_beating(s, "p")
    finally:
        release.set()
        tp.close()
        td.close()
