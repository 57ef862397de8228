"""The store warden's rules (cluster/transport/store_warden.py): every entry the cluster writes is kept,
each kind of junk goes, and a sweep never undoes a write that races it."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from cluster.transport.authenticated_store import AuthenticatedStore
from cluster.transport.rendezvous_store import start_store
from cluster.transport.store_warden import MAX_KEY_BYTES, MAX_VALUE_BYTES, Action, StoreWarden

SECRET = b"w" * 32
NS = "pdserve-0a1b2c3d"


def _sealer(secret: bytes = SECRET) -> AuthenticatedStore:
    return AuthenticatedStore(dist.HashStore(), secret)


# Every key shape the cluster writes (control.py, pair.py, torch_dist.py), with a value as written.
SEALED_KEYS = [f"{NS}/ctl/decode-0", f"{NS}/hb/prefill-0", f"{NS}/hb/decode-12",
               f"{NS}/verdict/prefill-0.1/decode-0.2/g0", f"{NS}/verdict/prefill-3.11/decode-1.4/g7",
               f"{NS}/down/prefill-0.2/decode-0.3", f"{NS}/x/prefill-0/decode-0.1/17",
               f"{NS}/pg/prefill-0.1/decode-0.2/g0/L0/0/0", f"{NS}/pg/prefill-3.1/decode-1.9/g2/L3/0/1"]


@pytest.mark.parametrize("key", SEALED_KEYS)
def test_a_sealed_entry_of_the_cluster_is_kept(key):
    w, s = StoreWarden(NS, SECRET), _sealer()
    for value in (b"ok", b"P", b"\x93\x01" * 100, b""):
        assert w.judge(key, s.seal(key, value)) == (Action.KEEP, b"")
    assert w.judge(key, b"") == (Action.KEEP, b"")  # a tombstone (or an empty raw value): absent to readers


@pytest.mark.parametrize("key,value", [(f"{NS}/inc/decode-0", b"1"), (f"{NS}/inc/prefill-0", b"-100"),
                                       (f"{NS}/inc/decode-0", b"0"), (f"{NS}/inc/decode-0", b"9223372036854775807"),
                                       (f"{NS}/pg/prefill-0.1/decode-0.1/g0/L0/seq", b"2")])
def test_an_add_counter_where_counters_live_is_kept(key, value):
    assert StoreWarden(NS, SECRET).judge(key, value) == (Action.KEEP, b"")


def test_add_writes_what_the_counter_rule_keeps():
    """The rule's shape is what TCPStore's add() really stores (a decimal int64)."""
    store = start_store("127.0.0.1", 0)
    w = StoreWarden(NS, SECRET)
    for delta in (1, -7, 2**40):
        store.add(f"{NS}/inc/decode-0", delta)
        assert w.judge(f"{NS}/inc/decode-0", store.get(f"{NS}/inc/decode-0"))[0] is Action.KEEP


@pytest.mark.parametrize("key", [
    "junk", "other-ns/ctl/decode-0", f"{NS}", f"{NS}/", f"{NS}/ctl", f"{NS}/ctl/a/b", f"{NS}/foo/decode-0",
    f"{NS}/verdict/prefill-0/decode-0/g0", f"{NS}/x/prefill-0/decode-0.1/seven", f"{NS}/pg/p.1/d.1/g0/L0/",
    f"{NS}/pg/p/d/g0/L0/0/0",
    f"{NS}/inc/", f"{NS}/ctl/" + "a" * MAX_KEY_BYTES, f"{NS}/pg/p.1/d.1/g0/L0/" + "k" * MAX_KEY_BYTES])
def test_a_key_the_cluster_never_writes_is_deleted(key):
    """Another namespace or shape, or past MAX_KEY_BYTES: deleted whatever it holds (sealed included)."""
    w = StoreWarden(NS, SECRET)
    assert w.kind(key) is None
    assert w.judge(key, _sealer().seal(key, b"v")) == (Action.DELETE, b"")
    assert w.judge(key, b"1")[0] is Action.DELETE


def test_junk_in_a_cluster_key_is_replaced_by_its_tombstone():
    w, s = StoreWarden(NS, SECRET), _sealer()
    ctl, hb, inc, pg = (f"{NS}/ctl/decode-0", f"{NS}/hb/decode-0", f"{NS}/inc/decode-0",
                        f"{NS}/pg/prefill-0.1/decode-0.1/g0/L0/0/0")
    cases = {
        "unsealed": (ctl, b"tcp://10.0.0.9:5555"),
        "a forged MAC": (ctl, b"\0" * 16 + b"tcp://10.0.0.9:5555"),
        "sealed for another key (moved)": (ctl, s.seal(f"{NS}/ctl/decode-1", b"e")),
        "sealed under another secret": (ctl, _sealer(b"x" * 32).seal(ctl, b"e")),
        "a raw counter where a sealed record lives": (hb, b"-1000000000"),
        "8 MiB of junk": (ctl, b"x" * (8 << 20)),
        "sealed, but past MAX_VALUE_BYTES": (ctl, s.seal(ctl, b"x" * MAX_VALUE_BYTES)),
        "a counter holding text": (inc, b"abc"),
        "a counter holding a sealed value": (inc, s.seal(inc, b"1")),
        "a counter past int64": (inc, b"1" * 20),
        "a huge counter value": (inc, b"1" * (2 << 20)),
        "junk in a pair's rendezvous": (pg, b"10.0.0.9:1234"),
    }
    for why, (key, value) in cases.items():
        want = b"0" if key == inc else b""
        assert w.judge(key, value) == (Action.TOMBSTONE, want), why


def test_a_namespace_is_one_segment():
    for ns in ("", "a/b"):
        with pytest.raises(ValueError):
            StoreWarden(ns, SECRET)


def _client(store) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10), use_libuv=True)


def test_a_sweep_removes_the_junk_and_keeps_the_cluster_entries():
    store = start_store("127.0.0.1", 0)
    sealed = AuthenticatedStore(_client(store), SECRET)
    rogue = _client(store)
    for key in SEALED_KEYS:
        sealed.set(key, b"value of " + key.encode())
    sealed.add(f"{NS}/inc/decode-0", 3)
    rogue.set("junk", b"x" * (8 << 20))
    for k in range(200):
        rogue.set(f"flood/{k}", b"1")
    rogue.set(f"{NS}/ctl/decode-7", b"x" * (8 << 20))
    rogue.set(f"{NS}/inc/prefill-9", b"not a number")
    rogue.set(f"{NS}/x/prefill-0/decode-0.1/18", b"P")  # a forged claim
    rogue.num_keys()  # (a set is not answered: a round trip on its connection says it was applied)
    r = StoreWarden(NS, SECRET).sweep(_client(store))
    assert (r.keys, r.deleted, r.tombstoned) == (len(SEALED_KEYS) + 1 + 1 + 200 + 3, 201, 3)
    assert set(store.list_keys()) == {*SEALED_KEYS, f"{NS}/inc/decode-0", f"{NS}/ctl/decode-7",
                                      f"{NS}/inc/prefill-9", f"{NS}/x/prefill-0/decode-0.1/18"}
    for key in SEALED_KEYS:
        assert sealed.read(key) == b"value of " + key.encode()
    assert store.get(f"{NS}/ctl/decode-7") == b"" and store.get(f"{NS}/inc/prefill-9") == b"0"
    assert sealed.add(f"{NS}/inc/decode-0", 1) == 4 and sealed.add(f"{NS}/inc/prefill-9", 1) == 1
    # A tombstone reads as absent: no value, no check, and a claim takes it.
    claim = f"{NS}/x/prefill-0/decode-0.1/18"
    assert sealed.read(claim) is None and not sealed.check([claim])
    assert sealed.compare_set(claim, "", b"P") == b"P" and sealed.read(claim) == b"P"
    again = StoreWarden(NS, SECRET).sweep(_client(store))
    assert (again.deleted, again.tombstoned) == (0, 0)  # tombstones and the claim stay as they are


class _RacingClient:
    """A client through which the real writer's sealed value lands just after the warden read the
    junk there (between its read and its replace)."""

    def __init__(self, raw, key: str, on_read):
        self.raw, self.key, self.on_read = raw, key, on_read

    def compare_set(self, key, expected, desired):
        got = self.raw.compare_set(key, expected, desired)
        if key == self.key and expected == desired and self.on_read is not None:
            self.on_read()
            self.on_read = None
        return got

    def __getattr__(self, name):
        return getattr(self.raw, name)


def test_a_write_racing_the_sweep_is_never_undone():
    store = start_store("127.0.0.1", 0)
    sealed = AuthenticatedStore(_client(store), SECRET)
    ctl, inc = f"{NS}/ctl/decode-0", f"{NS}/inc/decode-0"
    rogue = _client(store)
    rogue.set(ctl, b"forged endpoint")
    rogue.set(inc, b"junk")
    rogue.num_keys()
    w = StoreWarden(NS, SECRET)
    real = lambda: (sealed.set(ctl, b"the real endpoint"), sealed.num_keys())  # noqa: E731
    r = w.sweep(_RacingClient(_client(store), ctl, real))
    assert sealed.read(ctl) == b"the real endpoint" and r.tombstoned == 1  # (inc's junk only)
    rogue.set(inc, b"junk")
    rogue.num_keys()
    r = w.sweep(_RacingClient(_client(store), inc, lambda: (rogue.set(inc, b"5"), rogue.num_keys())))
    assert store.get(inc) == b"5" and r.tombstoned == 0
