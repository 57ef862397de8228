"""Link.check_beating: a peer is dead after peer_timeout_s of watching without news, and a look after an
idle gap that meets a replayed record is not such watching (the store's records: heartbeat_records.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from cluster.transport.heartbeat_records import HeartbeatRecords
from cluster.transport.link import Link
from cluster.transport.pair import PeerDeadError
from cluster.transport.transport_spec import TransportSpec

TIMEOUT, BEAT = 0.2, 0.02


class DictStore:
    """The verified view of the store that HeartbeatRecords reads (what AuthenticatedStore returns)."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def read(self, key):
        return self.d.get(key)

    def set(self, key, value):
        self.d[key] = value


def _link_and_peer():
    spec = TransportSpec("local", namespace="ns", heartbeat_s=BEAT, peer_timeout_s=TIMEOUT)
    link = Link(spec, "p", "prefill", DictStore, HeartbeatRecords("ns", "p"), payload=None,
                plan_spec=SimpleNamespace(block_size=4, block_bytes=8), numerics=None)
    peer = HeartbeatRecords("ns", "d")
    peer.incarnation = 1
    return link, peer, DictStore()


def _watch_until_dead(link, store, cap_s=5.0) -> float:
    """Looks every heartbeat until the peer is called dead; the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < cap_s:
        try:
            link.check_beating(store, "d")
        except PeerDeadError:
            return time.monotonic() - t0
        time.sleep(BEAT)
    raise AssertionError(f"a silent peer still alive after {cap_s} s of watching")


def test_a_silent_peer_is_dead_after_peer_timeout_s_of_watching():
    link, peer, store = _link_and_peer()
    for count in range(1, 4):
        peer.publish(store, count)
        link.check_beating(store, "d")
    assert _watch_until_dead(link, store) >= TIMEOUT  # never before: the next beat may still come


def test_a_look_after_a_gap_that_meets_a_replay_kills_nothing():
    """The sender looks only while transfers are in flight. A forger who puts back an old record just
    before the first look after an idle gap made that look say "silent for the whole gap": a beating
    peer was killed (one CI run of test_store_attacks)."""
    link, peer, store = _link_and_peer()
    peer.publish(store, 1)
    old = store.read("ns/hb/d")
    for count in range(2, 6):
        peer.publish(store, count)
        link.check_beating(store, "d")
    time.sleep(1.5 * TIMEOUT)  # idle: nobody looks; the peer beats on (counts 6.. overwritten next)
    peer.publish(store, 9)
    store.set("ns/hb/d", old)  # the replay, standing at the moment of the look
    link.check_beating(store, "d")  # no news, but no watching either: alive
    # A forgery that stands through peer_timeout_s of watching looks like a partition: dead then.
    assert _watch_until_dead(link, store) >= TIMEOUT


def test_news_keeps_a_watched_peer_alive():
    link, peer, store = _link_and_peer()
    t0, count = time.monotonic(), 0
    while time.monotonic() - t0 < 3 * TIMEOUT:
        count += 1
        peer.publish(store, count)
        link.check_beating(store, "d")
        time.sleep(BEAT)


def test_peer_timeout_must_span_several_heartbeats():
    with pytest.raises(ValueError, match="at least 4 heartbeats"):
        TransportSpec("local", heartbeat_s=0.5, peer_timeout_s=1.0)
