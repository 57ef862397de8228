"""AuthenticatedStore: the rendezvous store as the cluster reads it, every value under a MAC.

The store (the launcher's TCPStore; a tensor-parallel group's on the node's loopback) takes writes from
anyone who can reach its port. Everything the cluster trusts it with goes through this wrapper, built in
one place (`rendezvous_store.store_factory`, `TPGroup`), so a value no holder of the cluster's secret
wrote is never used:

    stored value = MAC (16 bytes) | value
    MAC = BLAKE2b-128 keyed with the secret, personalised "pdserve-store", over len(key) | key | value

The MAC binds the value to its full key, and every key names its writer and the writer's incarnation
(control.py's docstring has the layout: `ctl/D` carries D's incarnation in its value, the verdict, down,
claim and payload-rendezvous keys name both incarnations, a heartbeat record its writer's), so a
value moved to another key, or written by a process without the secret, is rejected:

- `get`/`wait` treat an invalid value as not there yet: they wait (up to the store's timeout) for a
  valid one, which the real writer's `set` puts in place. A forger can only delay.
- `check` is true only for keys that hold a valid value.
- `compare_set(key, "", v)`: an invalid value in the key counts as empty and is replaced atomically by
  v; a valid one is returned as it is. So a claim (pair.py) is decided between the holders of the
  secret only: a forged CLAIM or CANCEL neither wins nor cancels a transfer.
- `add` is the raw counter (torch's own rendezvous may count with it): nothing the cluster decides
  reads a counter any more (heartbeats and incarnations are sealed records, control.py).

Replays: a value copied back into its own key later is valid again. The keys that are rewritten
(heartbeats) carry a counter the reader only lets grow; the rest are written once per incarnation (and
generation), so an old value under a new key never verifies.

What a store client without the secret can still do is deny service: delete keys, overwrite them in a
loop. That is what anyone on the cluster's network can do by dropping packets; the store must listen
on the cluster's internal network only (RELIABILITY.md, security). Filling its memory is bounded: the
cluster's store runs in its own process under a memory cap, and its warden removes what no holder of
the secret wrote (store_process.py, store_warden.py).

NOTE: torch's PrefixStore cannot wrap a Python store (c10d raises "Not implemented" from it): use
`prefixed()` instead. HAZARD: keep a reference to the store as long as the process group made with
it: ProcessGroupNCCL reaches its store lazily (the first op exchanges the NCCL id), and once the
Python object is collected its overrides are gone ("Not implemented"; checked on an H200, torch 2.11).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import struct
import time

import torch.distributed as dist

from cluster.wire.frame_auth import require_secret

_MAC_BYTES = 16
_PERSON = b"pdserve-store"
_EMPTY_WAIT_S = 0.005  # first re-read of a key holding an invalid value (doubles up to 0.1 s)


def _as_bytes(v) -> bytes:
    if isinstance(v, str):
        return v.encode()
    return bytes(v)


def store_mac(secret: bytes, full_key: str, value: bytes) -> bytes:
    """The MAC of `value` stored under `full_key` (the layout in the module docstring)."""
    k = full_key.encode()
    h = hashlib.blake2b(struct.pack("<I", len(k)), digest_size=_MAC_BYTES, key=secret, person=_PERSON)
    h.update(k)
    h.update(value)
    return h.digest()


def unseal(secret: bytes, full_key: str, stored: bytes) -> bytes | None:
    """The value of an entry stored under `full_key`, or None if it is not sealed for that key under
    `secret` (constant-time compare). The rendezvous store's warden checks entries with it too."""
    if len(stored) >= _MAC_BYTES:
        value = stored[_MAC_BYTES:]
        if hmac.compare_digest(store_mac(secret, full_key, value), stored[:_MAC_BYTES]):
            return value
    return None


class AuthenticatedStore(dist.Store):
    """A c10d Store (ProcessGroupGloo/NCCL and init_process_group accept it) over `raw`: values are
    sealed on the way in and checked on the way out. One client per thread, like the raw store's."""

    def __init__(self, raw: dist.Store, secret: bytes, prefix: str = "", timeout_s: float | None = None):
        super().__init__()
        self._raw = raw
        self._key = require_secret(secret, "the rendezvous store")
        self._prefix = prefix
        self._timeout_s = timeout_s if timeout_s is not None else raw.timeout.total_seconds()
        self.rejected = 0  # values read that did not verify (a forgery, or a value moved to another key)

    def prefixed(self, prefix: str) -> AuthenticatedStore:
        """The same store under `prefix` (what dist.PrefixStore would do; it cannot wrap this class)."""
        return AuthenticatedStore(self._raw, self._key, self._prefix + prefix, self._timeout_s)

    # -- sealing ----------------------------------------------------------------------------------------
    def _mac(self, full_key: str, value: bytes) -> bytes:
        return store_mac(self._key, full_key, value)

    def seal(self, key: str, value) -> bytes:
        value = _as_bytes(value)
        return self._mac(self._prefix + key, value) + value

    def open(self, key: str, stored) -> bytes | None:
        """The value of a stored entry, or None (counted) if it is not sealed for this key."""
        value = unseal(self._key, self._prefix + key, _as_bytes(stored))
        if value is None:
            self.rejected += 1
        return value

    # -- the Store interface ----------------------------------------------------------------------------
    def set(self, key, value) -> None:
        self._raw.set(self._prefix + key, self.seal(key, value))

    def get(self, key) -> bytes:
        """Waits (up to the store's timeout) until the key holds a valid value."""
        deadline = time.monotonic() + self._timeout_s
        delay = _EMPTY_WAIT_S
        while True:
            value = self.open(key, self._raw.get(self._prefix + key))  # (the raw get waits for the key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rendezvous store key {self._prefix + key!r} holds no value sealed "
                                          "under the cluster's secret")
            time.sleep(delay)
            delay = min(2 * delay, 0.1)

    def read(self, key) -> bytes | None:
        """The key's value now, without waiting: None if it is absent or does not verify."""
        full = self._prefix + key
        if not self._raw.check([full]):
            return None
        return self.open(key, self._raw.get(full))

    def check(self, keys) -> bool:
        full = [self._prefix + k for k in keys]
        if not self._raw.check(full):
            return False
        return all(self.open(k, self._raw.get(f)) is not None for k, f in zip(keys, full))

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        delay = _EMPTY_WAIT_S
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rendezvous store keys {keys} not set (validly) within {limit:.0f} s")
            time.sleep(delay)
            delay = min(2 * delay, 0.1)

    def compare_set(self, key, expected, desired) -> bytes:
        """Atomic: sets `desired` if the key holds `expected` ("" = absent, or a value that does not
        verify: a forgery counts as absent); returns the key's value afterwards (the winner's)."""
        full, expected, desired = self._prefix + key, _as_bytes(expected), _as_bytes(desired)
        sealed = self.seal(key, desired)
        current = b"" if not expected else self.seal(key, expected)
        for _ in range(64):  # each round replaces one forgery; a forger racing us only delays
            got = _as_bytes(self._raw.compare_set(full, current, sealed))
            if got == sealed:
                return desired
            value = self.open(key, got) if got else None
            if value is not None:
                return value  # a holder of the secret wrote it first: theirs stands
            if expected:
                return b""  # the expected value is not there (nothing valid is)
            current = got  # a forgery (or a torn value): replace it atomically
        raise dist.DistStoreError(f"rendezvous store key {full!r} keeps being overwritten with forged values")

    def delete_key(self, key) -> bool:
        return self._raw.delete_key(self._prefix + key)

    def add(self, key, value: int) -> int:
        return self._raw.add(self._prefix + key, value)

    def num_keys(self) -> int:
        return self._raw.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
