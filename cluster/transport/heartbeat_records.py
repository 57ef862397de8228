"""HeartbeatRecords: the workers' liveness and incarnations in the (sealed) rendezvous store.

`{ns}/hb/W` holds W's record [incarnation, count], sealed like every value (authenticated_store.py);
W rewrites it every heartbeat_s with the next count, and with count CLOSED after a clean close.
Readers keep, per peer, the latest record they took, and take a new one only if it is later (a later
incarnation; within one, a higher count, the close after every count): a replayed older record, or a
value that does not verify, is no news. So a store client without the cluster's secret can make a
peer look silent at most (as a network partition would), never closed, restarted or alive.

Incarnations: `allocate` takes the next number of the raw counter `{ns}/inc/W` (unsealed: a counter),
stepping over any number at or below W's own last record's (a counter set back by someone else never
hands out an old number, whose claim keys may still stand). Peers read W's incarnation from its
records, never from the counter.

`keep`: an entry this worker publishes once (a decode worker's control endpoint) is checked with each
heartbeat and put back if a store client without the secret overwrote it (a forgery no peer takes):
so the forgery delays a new pair by a heartbeat at most.
"""

from __future__ import annotations

import threading

import msgspec

CLOSED = -1_000_000_000  # a record's count after a clean close


class HeartbeatRecords:
    """One worker's view: its own record (`publish`) and its peers' (`count_of`, `incarnation_of`).
    Thread-safe: the transport's threads share one."""

    def __init__(self, namespace: str, worker_id: str):
        self.ns, self.worker_id = namespace, worker_id
        self.incarnation = 0
        self._lock = threading.Lock()
        self._taken: dict[str, tuple[int, int]] = {}  # peer -> its latest record taken
        self._kept: dict[str, bytes] = {}  # key -> the value this worker keeps there

    def _key(self, worker: str) -> str:
        return f"{self.ns}/hb/{worker}"

    def allocate(self, store) -> int:
        """This worker's next incarnation (its new life starts with count 0)."""
        counter = f"{self.ns}/inc/{self.worker_id}"
        inc = int(store.add(counter, 1))
        last = self._read(store, self.worker_id)
        if last is not None and inc <= last[0]:  # the counter was set back: never reuse a number
            inc = int(store.add(counter, last[0] + 1 - inc))
        self.incarnation = inc
        self.publish(store, 0)
        return inc

    def keep(self, store, key: str, value: bytes) -> None:
        """Sets `key` now, and again at each publish() that finds it not holding `value`."""
        store.set(key, value)
        self._kept[key] = value

    def publish(self, store, count: int) -> None:
        store.set(self._key(self.worker_id), msgspec.msgpack.encode([self.incarnation, count]))
        for key, value in self._kept.items():
            if store.read(key) != value:
                store.set(key, value)

    def _read(self, store, worker: str) -> tuple[int, int] | None:
        raw = store.read(self._key(worker))
        if raw is None:
            return None
        try:
            inc, count = msgspec.msgpack.decode(raw)
            return int(inc), int(count)
        except (msgspec.DecodeError, TypeError, ValueError):
            return None  # (sealed, so a cluster member's, but not a record)

    def latest(self, store, peer: str) -> tuple[int, int] | None:
        """The peer's latest record: the one in the store if it is later than the last one taken."""
        rec = self._read(store, peer)

        def order(r):  # later incarnation first; within one, its close after every count
            return (r[0], r[1] if r[1] >= 0 else float("inf"))
        with self._lock:
            last = self._taken.get(peer)
            if rec is not None and (last is None or order(rec) >= order(last)):
                self._taken[peer] = last = rec
        return last

    def count_of(self, store, peer: str) -> int:
        """The peer's heartbeat count (negative: it closed; 0: not started yet, or nothing valid)."""
        rec = self.latest(store, peer)
        return rec[1] if rec is not None else 0

    def incarnation_of(self, store, peer: str) -> int:
        rec = self.latest(store, peer)
        return rec[0] if rec is not None else 0
