"""RankWatchdog in one process, over a scripted store: a rank is dead after peer_timeout_s of watched
silence, and a look after the watchdog's own thread stalled, at a moment a replayed count stands in the
store, fails nothing (silence_watch.py; the processes themselves: test_watchdog.py)."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.distributed.watchdog import RankWatchdog

BEAT, TIMEOUT = 0.02, 0.2


class ScriptedStore:
    """Rank 1's counter beats on its own (`beating`); `stall_then_replay()` makes the watchdog's next
    read of it take 3 timeouts and return an old count, and the read after that the same old count."""

    def __init__(self):
        self.d: dict[str, str] = {}
        self.t0, self.beating, self._replays = time.monotonic(), True, 0
        self._frozen: int | None = None

    def set(self, key, value):
        self.d[key] = value

    def stall_then_replay(self):
        self._replays = 2

    def read(self, key):
        if not key.endswith("/hb/1"):
            return self.d.get(key)
        if self._replays:
            if self._replays == 2:
                time.sleep(3 * TIMEOUT)  # this thread did not run (a loaded host, a long GIL hold)
            self._replays -= 1
            return "1"  # a replayed record: older than what the watchdog took
        if self.beating:
            self._frozen = int((time.monotonic() - self.t0) / BEAT) + 2
        return str(self._frozen)


def _watch(store):
    failed, done = [], threading.Event()

    def on_failure(why):
        failed.append(why)
        done.set()
    w = RankWatchdog(lambda: store, "ns", 0, 2, BEAT, TIMEOUT, on_failure)
    w.start()
    return w, failed, done


def test_a_stalled_look_that_meets_a_replay_fails_nothing():
    store = ScriptedStore()
    w, failed, done = _watch(store)
    try:
        time.sleep(5 * BEAT)
        store.stall_then_replay()
        assert not done.wait(6 * TIMEOUT), failed  # the peer beats on: alive
        store.beating = False  # now it stops: found dead after TIMEOUT of watching
        assert done.wait(10), "a silent rank was never found dead"
        assert "sent no heartbeat" in failed[0]
    finally:
        w.stop(clean=False)
        w.join(5)


def test_a_rank_that_never_beats_is_dead_after_the_timeout():
    store = ScriptedStore()
    store.beating, store._frozen = False, None
    store.read = lambda key: None if key.endswith("/hb/1") else store.d.get(key)
    t0 = time.monotonic()
    w, failed, done = _watch(store)
    try:
        assert done.wait(10) and "sent no heartbeat" in failed[0]
        assert time.monotonic() - t0 >= TIMEOUT
    finally:
        w.stop(clean=False)
        w.join(5)


def test_timing_that_would_never_find_a_dead_rank_is_refused():
    with pytest.raises(ValueError, match="at least 4 heartbeats"):
        RankWatchdog(lambda: None, "ns", 0, 2, 0.5, 1.0)
