"""The control plane both store-coordinated transports share: a TCPStore (or an in-process HashStore)
carries each transfer's header, handshake and acknowledgement; the bulk KV goes another way
(torch.distributed point-to-point, or a direct write into the decode worker's pool).

Keys, per transfer (P = prefill worker id, D = decode worker id, s = transfer_seq):
  {ns}/x/P/D/s/h  header: the prefill *claims* the transfer with compare_set("", header); the decode side
                  *cancels* it with compare_set("", CANCEL) when its expect deadline passes. Exactly one
                  wins, atomically: after a cancel nothing can land in the reserved blocks, after a claim
                  the decode side waits for the payload (bounded by transfer_timeout_s) before it reports.
  {ns}/x/P/D/s/r  decode -> prefill: receives posted ("1") or rejected (reason)   [torch_dist only]
  {ns}/x/P/D/s/a  landed: decode -> prefill (torch_dist) or prefill -> decode (same_gpu)
  {ns}/hb/W       heartbeat counter of worker W (store.add every heartbeat_s); -1 after a clean close.

The header is a fixed little-endian int64 vector (what a header tensor would hold) plus the request id
in UTF-8: no pickle.
"""

from __future__ import annotations

import datetime
import heapq
import socket
import threading
import time
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cluster.messages import KVHeader, Reservation
from cluster.transport.base import KVArrival, KVTransport, TransferStats

CANCEL = b"C"
_HEADER_MAGIC = 0x5044_4B56  # "PDKV"
_HEADER_FIELDS = 8  # magic, transfer_seq, num_tokens, first_token, ok, num_blocks, bytes_per_block, rid_len


def encode_header(h: KVHeader, num_blocks: int, bytes_per_block: int) -> bytes:
    rid = h.request_id.encode()
    fields = np.array([_HEADER_MAGIC, h.transfer_seq, h.num_tokens, h.first_token, int(h.ok), num_blocks,
                       bytes_per_block, len(rid)], dtype="<i8")
    return fields.tobytes() + rid


def decode_header(raw: bytes) -> tuple[KVHeader, int, int]:
    """-> (header, num_blocks, bytes_per_block)."""
    n = 8 * _HEADER_FIELDS
    f = np.frombuffer(raw[:n], dtype="<i8")
    if len(raw) < n or int(f[0]) != _HEADER_MAGIC or len(raw) != n + int(f[7]):
        raise ValueError(f"malformed KV header ({len(raw)} bytes)")
    rid = raw[n:].decode()
    return KVHeader(rid, int(f[1]), int(f[2]), int(f[3]), ok=bool(f[4])), int(f[5]), int(f[6])


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (the cluster's internal network): what gloo binds."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 1))  # UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]


def start_store(host: str, port: int = 0, timeout_s: float = 60.0) -> dist.TCPStore:
    """The launcher hosts the rendezvous store (so it outlives any worker) on the internal address.
    port=0 picks a free port: read it back from `store.port`."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)


class PeerDeadError(RuntimeError):
    """The peer shut down, stopped heart-beating, or broke a point-to-point operation."""


class TransferRejected(RuntimeError):
    """The decode side refused a claimed transfer before any payload moved (the pair stays usable)."""


class _PairBroken(Exception):
    """Raised inside a transfer after its claim: the pair's state is unknown, so the peer is marked dead."""


@dataclass
class _Pending:
    reservation: Reservation
    deadline: float  # monotonic: cancel the transfer if it is still unclaimed then


class StoreCoordinatedTransport(KVTransport):
    """Everything but the payload: claims, cancels, heartbeats, per-peer receive threads, metrics.

    Subclasses move the bytes: `_push` (prefill side, after the claim) and `_pull` (decode side, after it
    read a claim). Both raise on failure; any failure after a claim marks the peer dead (see `_mark_dead`).
    """

    def __init__(self, spec, kv_cache: torch.Tensor, worker_id: str, role: str, store_factory):
        assert role in ("prefill", "decode"), role
        self.spec = spec
        self.kv_cache = kv_cache
        self.worker_id = worker_id
        self.role = role
        self._new_store = store_factory  # one client per thread: TCPStore clients are not shared
        self._local = threading.local()
        self.ns = spec.namespace
        self.bytes_per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._dead: dict[str, str] = {}  # peer -> why
        self._arrivals: deque[KVArrival] = deque()
        self._receivers: dict[str, _PeerReceiver] = {}
        self._liveness: dict[str, tuple[int, float]] = {}
        self._records: deque[dict] = deque(maxlen=1024)
        self._totals = {"transfers": 0, "bytes": 0, "seconds": 0.0, "failures": 0}
        self._heartbeat = threading.Thread(target=self._beat, name=f"kv-heartbeat-{worker_id}", daemon=True)
        self._heartbeat.start()

    # -- keys and store helpers -----------------------------------------------------------------
    def _store(self):
        s = getattr(self._local, "store", None)
        if s is None:
            s = self._local.store = self._new_store()
        return s

    def _key(self, prefill: str, decode: str, seq: int, what: str) -> str:
        return f"{self.ns}/x/{prefill}/{decode}/{seq}/{what}"

    def _beat(self) -> None:
        store, key = self._new_store(), f"{self.ns}/hb/{self.worker_id}"
        while not self._closed.is_set():
            try:
                store.add(key, 1)
            except Exception:  # store gone: peers will see us as silent, which is the truth
                pass
            self._closed.wait(self.spec.heartbeat_s)

    def _check_alive(self, store, peer: str) -> None:
        if peer in self._dead:
            raise PeerDeadError(f"peer {peer} is marked dead: {self._dead[peer]}")
        v, now = store.add(f"{self.ns}/hb/{peer}", 0), time.monotonic()
        if v < 0:
            raise PeerDeadError(f"peer {peer} has shut down its KV transport")
        with self._lock:
            last_v, since = self._liveness.get(peer, (None, now))
            if v != last_v:
                self._liveness[peer] = (v, now)
            elif v > 0 and now - since > self.spec.peer_timeout_s:
                # (v == 0: the peer never started its transport; only the expect deadline judges it)
                raise PeerDeadError(f"peer {peer} silent for {now - since:.1f}s (no heartbeat within "
                                    f"peer_timeout_s={self.spec.peer_timeout_s}): presumed dead")

    def _wait_key(self, store, key: str, peer: str, deadline: float, what: str) -> bytes | None:
        """Polls until `key` exists (-> its value); None at the deadline; raises if the peer died."""
        delay, next_live = 5e-5, 0.0
        while True:
            if store.check([key]):
                return store.get(key)
            now = time.monotonic()
            if now >= deadline:
                return None
            if self._closed.is_set():
                raise RuntimeError(f"KV transport of {self.worker_id} closed while waiting for {what}")
            if now >= next_live:
                self._check_alive(store, peer)
                next_live = now + self.spec.heartbeat_s
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 2e-3)

    def _mark_dead(self, peer: str, why: str) -> None:
        with self._lock:
            self._dead.setdefault(peer, why)
        self._on_peer_dead(peer)
        rx = self._receivers.get(peer)
        if rx is not None:
            rx.wake()

    def _on_peer_dead(self, peer: str) -> None:
        """Subclass hook: tear down the pair's channel (e.g. abort an NCCL communicator)."""

    def _record(self, side: str, request_id: str, nbytes: int, seconds: float, ok: bool, peer: str) -> TransferStats:
        st = TransferStats(nbytes, seconds)
        with self._lock:
            self._records.append({"side": side, "peer": peer, "request_id": request_id, "bytes": nbytes,
                                  "seconds": seconds, "GBps": st.gbps, "ok": ok})
            if ok:
                self._totals["transfers"] += 1
                self._totals["bytes"] += nbytes
                self._totals["seconds"] += seconds
            else:
                self._totals["failures"] += 1
        return st

    def metrics(self) -> dict:
        """Totals plus the last transfers ({side, peer, request_id, bytes, seconds, GBps, ok})."""
        with self._lock:
            t = dict(self._totals)
            t["GBps"] = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] > 0 else 0.0
            t["dead_peers"] = dict(self._dead)
            t["recent"] = list(self._records)
        return t

    # -- prefill side ---------------------------------------------------------------------------
    def send(self, reservation: Reservation, header: KVHeader, src_block_ids: list[int], timeout_s: float) -> TransferStats:
        peer, seq = reservation.decode_worker_id, reservation.transfer_seq
        if header.transfer_seq != seq or header.request_id != reservation.request_id:
            raise ValueError(f"header {header} does not match reservation {reservation}")
        if peer in self._dead:
            raise PeerDeadError(f"decode worker {peer} is marked dead: {self._dead[peer]}")
        if header.ok and len(src_block_ids) > len(reservation.block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks but only {len(reservation.block_ids)} reserved")
        store, t0 = self._store(), time.perf_counter()
        hkey = self._key(self.worker_id, peer, seq, "h")
        raw = encode_header(header, len(src_block_ids) if header.ok else 0, self.bytes_per_block)
        got = store.compare_set(hkey, "", raw)
        if got == CANCEL:
            store.delete_key(hkey)
            self._record("send", header.request_id, 0, time.perf_counter() - t0, False, peer)
            raise TimeoutError(f"decode worker {peer} gave up on transfer {seq} ({header.request_id}) before it was "
                               f"sent (expect_timeout_s={self.spec.expect_timeout_s}); its blocks are back in its pool")
        if got != raw:
            raise RuntimeError(f"transfer {seq} to {peer} was already claimed by another header")
        if not header.ok or not src_block_ids:
            return self._record("send", header.request_id, 0, time.perf_counter() - t0, True, peer)
        deadline = time.monotonic() + timeout_s
        try:
            nbytes = self._push(store, reservation, src_block_ids, deadline)
        except TransferRejected:
            self._record("send", header.request_id, 0, time.perf_counter() - t0, False, peer)
            raise
        except Exception as e:
            self._mark_dead(peer, f"transfer {seq} ({header.request_id}) failed: {e}")
            self._record("send", header.request_id, 0, time.perf_counter() - t0, False, peer)
            if isinstance(e, (TimeoutError, PeerDeadError)):
                raise
            raise RuntimeError(f"KV transfer {seq} ({header.request_id}) to {peer} failed: {e}") from e
        return self._record("send", header.request_id, nbytes, time.perf_counter() - t0, True, peer)

    @abstractmethod
    def _push(self, store, reservation: Reservation, src_block_ids: list[int], deadline: float) -> int:
        """After a successful claim: move the payload; return bytes moved once the decode side has it."""

    # -- decode side ----------------------------------------------------------------------------
    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        with self._lock:
            rx = self._receivers.get(prefill_worker_id)
            if rx is None:
                rx = self._receivers[prefill_worker_id] = _PeerReceiver(self, prefill_worker_id)
                rx.start()
        rx.add(_Pending(reservation, time.monotonic() + self.spec.expect_timeout_s))

    def poll_arrivals(self) -> list[KVArrival]:
        out = []
        while self._arrivals:
            out.append(self._arrivals.popleft())
        return out

    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        """Decode side: stop waiting for this transfer as soon as possible (it still arrives, failed, or
        landed if the prefill had already claimed it): the blocks stay reserved until that arrival."""
        rx = self._receivers.get(prefill_worker_id)
        if rx is not None:
            rx.cancel(reservation.transfer_seq)

    def _receive_one(self, store, peer: str, p: _Pending) -> KVArrival:
        res = p.reservation
        hkey = self._key(peer, self.worker_id, res.transfer_seq, "h")
        try:
            raw = self._wait_key(store, hkey, peer, p.deadline, f"header of transfer {res.transfer_seq}")
            if peer in self._dead:
                why = f"PeerDeadError: peer {peer} is marked dead: {self._dead[peer]}"
            elif self._closed.is_set():
                why = "RuntimeError: the KV transport closed"
            elif p.deadline == 0.0:
                why = "cancelled by the decode worker"
            else:
                why = f"TimeoutError: no KV from {peer} within expect_timeout_s={self.spec.expect_timeout_s}"
        except PeerDeadError as e:
            raw, why = None, f"PeerDeadError: {e}"
            self._mark_dead(peer, str(e))
        if raw is None:
            raw = store.compare_set(hkey, "", CANCEL)
            if raw == CANCEL:  # cancelled: nothing can land in these blocks any more
                self._record("recv", res.request_id, 0, 0.0, False, peer)
                return KVArrival(res, None, TransferStats(0, 0.0), error=why)
            # else the prefill claimed it in the meantime: take it
        t0 = time.perf_counter()
        header, nblocks, bpb = decode_header(raw)
        if header.request_id != res.request_id or header.transfer_seq != res.transfer_seq:
            raise _PairBroken(f"protocol error: expected {res.request_id}#{res.transfer_seq}, got {header}")
        if not header.ok:
            store.delete_key(hkey)
            self._record("recv", res.request_id, 0, time.perf_counter() - t0, True, peer)
            return KVArrival(res, header, TransferStats(0, time.perf_counter() - t0), error="prefill aborted or failed")
        if bpb != self.bytes_per_block or nblocks > len(res.block_ids) or nblocks < -(-header.num_tokens // self.kv_cache.shape[3]):
            reason = f"layout mismatch: {nblocks} blocks x {bpb} B for {header.num_tokens} tokens, reserved {len(res.block_ids)} x {self.bytes_per_block} B"
            self._reject(store, peer, res, reason)
            self._record("recv", res.request_id, 0, 0.0, False, peer)
            return KVArrival(res, header, TransferStats(0, 0.0), error=reason)
        try:
            nbytes = self._pull(store, peer, res, nblocks, time.monotonic() + self.spec.transfer_timeout_s)
        except Exception as e:
            raise _PairBroken(f"{type(e).__name__}: {e}") from e
        store.delete_key(hkey)
        st = self._record("recv", res.request_id, nbytes, time.perf_counter() - t0, True, peer)
        return KVArrival(res, header, st)

    def _reject(self, store, peer: str, res: Reservation, reason: str) -> None:
        store.set(self._key(peer, self.worker_id, res.transfer_seq, "r"), reason.encode())

    @abstractmethod
    def _pull(self, store, peer: str, res: Reservation, nblocks: int, deadline: float) -> int:
        """After reading a claim: land the payload in res.block_ids[:nblocks]; return bytes."""

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for rx in list(self._receivers.values()):
            rx.wake()
            rx.join(timeout=5)
        self._heartbeat.join(timeout=5)
        try:
            self._new_store().set(f"{self.ns}/hb/{self.worker_id}", b"-1000000000")
        except Exception:
            pass


class _PeerReceiver(threading.Thread):
    """Decode side: works through one prefill peer's transfers in transfer_seq order. Every expected
    transfer ends as exactly one KVArrival: landed, aborted, timed out, or failed with its peer."""

    def __init__(self, transport: StoreCoordinatedTransport, peer: str):
        super().__init__(name=f"kv-recv-{transport.worker_id}<-{peer}", daemon=True)
        self.t, self.peer = transport, peer
        self._cv = threading.Condition()
        self._heap: list[tuple[int, _Pending]] = []
        self._cancelled: set[int] = set()

    def add(self, p: _Pending) -> None:
        with self._cv:
            heapq.heappush(self._heap, (p.reservation.transfer_seq, id(p), p))
            self._cv.notify()

    def cancel(self, seq: int) -> None:
        with self._cv:
            for _, _, p in self._heap:
                if p.reservation.transfer_seq == seq:
                    p.deadline = 0.0
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def run(self) -> None:
        t, store = self.t, self.t._new_store()
        while True:
            with self._cv:
                while not self._heap and not t._closed.is_set():
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, p = self._heap[0]
            closing = t._closed.is_set()
            if closing or self.peer in t._dead:
                p.deadline = 0.0  # still try to cancel first: a claimed transfer may be landing
            try:
                arrival = t._receive_one(store, self.peer, p)
            except Exception as e:
                why = str(e)
                t._mark_dead(self.peer, why)
                t._record("recv", p.reservation.request_id, 0, 0.0, False, self.peer)
                arrival = KVArrival(p.reservation, None, TransferStats(0, 0.0), error=f"PeerDeadError: {why}")
            with self._cv:
                heapq.heappop(self._heap)
            t._arrivals.append(arrival)
