"""StoreWarden: sweeps the cluster's rendezvous store (in the store's own process, store_process.py) and
removes what no holder of the cluster's secret wrote, so that a client filling the store is undone
long before the process's memory cap is reached.

What the cluster writes there, every key under its namespace `{ns}/` (control.py's docstring has the
meaning of each; W is a worker id, i, j, G, s, L integers):

    {ns}/ctl/W  {ns}/hb/W  {ns}/verdict/W.i/W.j/gG  {ns}/down/W.i/W.j  {ns}/x/W/W.i/s sealed
    {ns}/inc/W                                                                        an add() counter
    {ns}/pg/W.i/W.j/gG/L<n>/<anything> a pair's gloo/NCCL rendezvous: sealed (c10d reads and writes
                                       through AuthenticatedStore), or an add() counter of c10d's

A sealed value is MAC | value (authenticated_store.py). An add() counter is what TCPStore's add
stores: a decimal int64, and add() is the only way c10d or the cluster writes an unsealed value (every
other write through the wrapper is sealed; checked on a live gloo pair: `0/0`, `0/1`, both sealed, no
counter; ProcessGroupNCCL reaches the Python store through the same methods). Nothing else is written
(a client made with wait_for_workers=False adds no `init/` key).

Rules, per entry (`judge`):
- a key past MAX_KEY_BYTES, or one no rule above matches (another namespace, another shape): deleted.
  No cluster process ever writes such a key, so deleting it can race with nobody.
- an empty value: kept (the tombstone below; readers take it for "absent").
- a value past MAX_VALUE_BYTES (no cluster value comes near it: the largest, `ctl/W`, is a few KiB),
  or one that is neither sealed for its key nor a counter where counters live: replaced, atomically
  and only if it still holds what was read (`compare_set(key, junk, tombstone)`), by a tombstone: b""
  (every reader treats it as absent: `get`/`wait` wait for a valid value, `check` is False, a claim's
  `compare_set(key, "", v)` takes an empty value as absent) or b"0" for an `inc/` counter (add() parses
  it; a counter set back is harmless: heartbeat_records.py). A key a cluster process may be writing is
  never deleted: a delete racing its `set` or a claim's `compare_set` would lose that write.
So junk under any other key is gone with its memory (the child then calls malloc_trim). Junk under a
key of the cluster's shapes is harmless at once, but its memory stays: TCPStore reuses a value's
buffer when the value is overwritten (a tombstone keeps the junk's capacity), and only a delete, or the
cluster's own delete of that key (a claim once its transfer arrived), frees it. That is bounded by the
process's memory cap only (RELIABILITY.md, what stays out of scope).

Reading never blocks: `compare_set(key, SENTINEL, SENTINEL)` returns the value, or SENTINEL for a key
deleted since the listing (a `get` would wait for it up to the store's timeout, and a timed-out wait
leaves the client's replies out of step).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from enum import Enum

from cluster.transport.authenticated_store import unseal
from cluster.wire.frame_auth import require_secret

MAX_KEY_BYTES = 512  # the cluster's longest keys (pg rendezvous) are ~100 bytes
MAX_VALUE_BYTES = 1 << 20  # the cluster's largest value (a decode worker's ctl entry) is a few KiB
_COUNTER = re.compile(rb"-?[0-9]{1,19}")  # what TCPStore's add() stores: std::to_string(int64)


class Kind(Enum):
    SEALED = "sealed"
    COUNTER = "counter"  # an add() counter of ours
    RENDEZVOUS = "rendezvous"  # a pair's c10d rendezvous: sealed, or c10d's own add() counter


class Action(Enum):
    KEEP = "keep"
    DELETE = "delete"  # a key no cluster process writes
    TOMBSTONE = "tombstone"  # the value replaced (if unchanged) by the key's tombstone


@dataclass(frozen=True)
class SweepResult:
    keys: int  # listed
    deleted: int
    tombstoned: int
    seconds: float


class StoreWarden:
    """Judges and sweeps the entries of one cluster's store (`namespace`, `secret`: the cluster's)."""

    def __init__(self, namespace: str, secret: bytes):
        if not namespace or "/" in namespace:
            raise ValueError(f"a store namespace is one path segment, not {namespace!r}")
        self.secret = require_secret(secret, "the rendezvous store's warden")
        ns = re.escape(namespace)
        w, n = r"[^/]+", r"[0-9]+"
        self._shapes = [
            (re.compile(rf"{ns}/(ctl|hb)/{w}"), Kind.SEALED),
            (re.compile(rf"{ns}/verdict/{w}\.{n}/{w}\.{n}/g{n}"), Kind.SEALED),
            (re.compile(rf"{ns}/down/{w}\.{n}/{w}\.{n}"), Kind.SEALED),
            (re.compile(rf"{ns}/x/{w}/{w}\.{n}/{n}"), Kind.SEALED),
            (re.compile(rf"{ns}/inc/{w}"), Kind.COUNTER),
            (re.compile(rf"{ns}/pg/{w}\.{n}/{w}\.{n}/g{n}/L{n}/.+", re.S), Kind.RENDEZVOUS),
        ]
        self._sentinel = b"\0pdserve-warden\0" + os.urandom(16)  # never a stored value

    def kind(self, key: str) -> Kind | None:
        """The cluster's kind of entry `key` is, or None if the cluster never writes it."""
        if len(key.encode()) > MAX_KEY_BYTES:
            return None
        for shape, kind in self._shapes:
            if shape.fullmatch(key):
                return kind
        return None

    def judge(self, key: str, value: bytes) -> tuple[Action, bytes]:
        """What to do with `key` holding `value`: (action, the tombstone for TOMBSTONE)."""
        kind = self.kind(key)
        if kind is None:
            return Action.DELETE, b""
        tombstone = b"0" if kind is Kind.COUNTER else b""
        if not value or (kind is Kind.COUNTER and value == tombstone):
            return Action.KEEP, b""
        if len(value) > MAX_VALUE_BYTES:
            return Action.TOMBSTONE, tombstone
        if kind is not Kind.SEALED and _COUNTER.fullmatch(value):
            return Action.KEEP, b""
        if kind is not Kind.COUNTER and unseal(self.secret, key, value) is not None:
            return Action.KEEP, b""
        return Action.TOMBSTONE, tombstone

    def sweep(self, client) -> SweepResult:
        """One pass over every key of the store through `client` (a raw TCPStore client)."""
        start = time.monotonic()
        keys = client.list_keys()
        deleted = tombstoned = 0
        for key in keys:
            if self.kind(key) is None:
                client.delete_key(key)
                deleted += 1
                continue
            value = client.compare_set(key, self._sentinel, self._sentinel)  # a read that never waits
            if value == self._sentinel:
                continue  # deleted since the listing
            action, tombstone = self.judge(key, value)
            if action is Action.TOMBSTONE:
                # Atomic: replaced only if it still holds the junk (a writer's value since then stays).
                if client.compare_set(key, value, tombstone) == tombstone:
                    tombstoned += 1
            del value  # (up to a junk value's size: not held across the loop)
        return SweepResult(len(keys), deleted, tombstoned, time.monotonic() - start)
