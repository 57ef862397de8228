"""The control plane every KV transport shares; how the payload moves is a subclass's (torch_dist.py:
NCCL/gloo point-to-point, same_gpu.py: CUDA IPC copies).

The store (the launcher's TCPStore, or an in-process HashStore in tests) holds ownership and liveness
only, never anything a transfer waits for:
  {ns}/x/P/D.i/s the claim of transfer s from prefill P to incarnation i of decode D. The prefill claims with
                 compare_set("", CLAIM) (ABORT: a transfer that carries no KV) before any byte can
                 reach the reserved blocks; the decode side cancels with compare_set("", CANCEL) when
                 its expect deadline passes or it is asked to. Exactly one wins, atomically: after a
                 cancel nothing lands. The decode side deletes a claim once the transfer arrived; the
                 prefill deletes a CANCEL it read.
  {ns}/hb/W      heartbeat counter of worker W (store.add every heartbeat_s); -1e9 after a clean close.
  {ns}/inc/W     W's incarnation counter: each transport a worker starts (a Ray restart of its actor
                 starts another) takes the next number.
  {ns}/ctl/D     decode worker D's control endpoint, incarnation, KV layout and payload extras (its IPC pool).
Everything else travels on the push channel (channel.py), prefill -> decode, in order per pair.

Restarts. A worker restarted under its id is a new incarnation: its pairs are formed anew (the
payload channel's rendezvous is per pair of incarnations), and whatever was in flight with the old
one fails on the survivor, its reserved or source blocks freed: a decode worker fails the old pair
and the old prefill's pending transfers when the new prefill's Hello arrives; a prefill worker, on
connect(), re-forms a pair whose decode peer published a new incarnation. Claim keys carry the
decode incarnation, and a decode worker's transfer_seq only grows per prefill peer, so no key of an
old incarnation is ever taken for a new transfer. `peer_died` lets the caller (the router, told by
Ray) mark a peer dead at once instead of after peer_timeout_s.

One shipment (what one prefill forward sends): `begin` before the forward claims each transfer and
pushes a Begin (one bundle per decode peer); the decode side posts its receives for the whole bundle
on the pair's own CUDA stream at once. Each launch of the plan is issued on the prefill's pair stream
once the layers it carries are computed (a CUDA event recorded by a forward hook on the compute stream:
neither stream ever waits for the other's work beyond that). After sampling, `commit` pushes a Commit
with the first tokens. The decode loop reports a transfer from poll_arrivals() once the Commit arrived
and a query() of the bundle's completion (completion.py) says the payload landed: it never waits on a
transfer. A waiter thread per pair blocks on that completion only to wake the loop (or, prefill side,
to free the source blocks).

Failure: a peer whose heartbeat stalls peer_timeout_s, a claimed transfer silent for transfer_timeout_s,
or a payload error marks the peer dead: its channel is aborted (NCCL: ncclCommAbort) and every transfer
with it fails, each only once its completion says nothing can still write the blocks.

Threads: (both) a heartbeat thread, which on the prefill side also watches the peers of transfers in
flight; one waiter per pair; (decode) the control thread, which owns the inbox, posts receives and runs
deadlines, cancels and liveness checks.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from cluster.logprobs import PrefillLogprobs
from cluster.messages import KVHeader, Reservation
from cluster.transport.base import KVArrival, KVSend, KVTransport, Shipment, TransferStats
from cluster.transport.channel import Abort, Begin, Commit, Hello, Inbox, Message, Outbox
from cluster.transport.completion import Completion, ReadyCompletion, Waiter
from cluster.transport.plan import ItemPlan, Launch, fingerprint, launch_last_layer

log = logging.getLogger(__name__)

CLAIM, ABORT, CANCEL = b"P", b"A", b"C"

_LIVE: "weakref.WeakSet[ControlledTransport]" = weakref.WeakSet()


@atexit.register
def _close_live_transports() -> None:
    """At exit, before the interpreter stops its daemon threads: one stopped inside a torch call (a
    store access, an event wait) would be unwound through C++ and abort the process."""
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (the cluster's internal network): what we bind."""
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
    """The peer shut down, stopped heart-beating, or broke the pair's channel."""


# -- per pair and per bundle state --------------------------------------------------------------
class Pair:
    """One prefill-decode pair as this side sees it."""

    def __init__(self, peer: str, me: str):
        self.peer = peer
        self.peer_inc = 0  # the peer's incarnation this pair was formed with
        self.order = threading.Lock()  # prefill: held from a bundle's begin until its last launch is issued
        self.io = threading.Lock()  # the payload channel is used by one thread at a time (abort included)
        self.outbox: Outbox | None = None
        self.payload: Any = None  # the subclass's per-pair state
        self.waiter = Waiter(f"kv-wait-{me}-{peer}")
        self.bundles: list = []  # in flight
        self.dead: str | None = None


@dataclass(eq=False)
class _OutBundle:
    id: int
    pair: Pair
    sends: list[KVSend]
    futures: list[Future]
    items: list[ItemPlan]
    launches: list[Launch]
    issued: int = 0
    payload: Any = None  # the subclass's per-bundle state
    completion: Completion | None = None
    commit_event: int = -1
    failed: str | None = None
    t_kv: float = 0.0  # monotonic: the forward finished (the transfer's exposed part starts)
    unlocked: bool = False


@dataclass(eq=False)
class _Expect:
    reservation: Reservation
    peer: str
    deadline: float  # monotonic
    state: str = "waiting"  # -> "claimed" (the deadline passed but the prefill had claimed it)
    cancel: bool = False


@dataclass(eq=False)
class _InBundle:
    id: int
    pair: Pair
    expects: list[_Expect]
    num_tokens: list[int]
    items: list[ItemPlan]
    launches: list[Launch]
    t_begin: float  # monotonic
    completion: Completion | None = None
    committed: bool = False
    tokens: list[int] = field(default_factory=list)
    oks: list[bool] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per item: PrefillLogprobs or None (empty: none asked)
    failed: str | None = None
    payload: Any = None


class _Shipment(Shipment):
    def __init__(self, transport: "ControlledTransport"):
        self.t = transport
        self.futures: dict[str, Future] = {}
        self.bundles: list[_OutBundle] = []
        self._kv_done = self._committed = False

    def layer_done(self, layer: int) -> None:
        if self._kv_done or not any(b.issued < len(b.launches) and launch_last_layer(b.launches[b.issued]) <= layer
                                    for b in self.bundles):
            return  # no launch waits for this layer (not layer-wise, or already issued)
        ready = self.t._payload_mark()
        for b in self.bundles:
            self.t._issue_through(b, layer, ready)

    def kv_done(self) -> None:
        if self._kv_done:
            return
        self._kv_done = True
        ready = self.t._payload_mark() if self.bundles else None
        for b in self.bundles:
            self.t._issue_through(b, None, ready)
            self.t._seal(b)

    def commit(self, first_tokens: Mapping[str, int | None],
               logprobs: Mapping[str, PrefillLogprobs] | None = None) -> None:
        if self._committed:
            raise RuntimeError("shipment committed twice")
        self.kv_done()
        self._committed = True
        for b in self.bundles:
            self.t._commit(b, first_tokens, logprobs or {})


class ControlledTransport(KVTransport):
    """Claims, cancels, heartbeats, the push channel, deadlines, completions and metrics. Subclasses
    implement the `_payload_*` hooks; they are called with `pair.io` held where they touch a channel."""

    def __init__(self, spec, kv_cache: torch.Tensor, worker_id: str, role: str, store_factory):
        assert role in ("prefill", "decode"), role
        self.spec = spec
        self.kv_cache = kv_cache
        self.worker_id = worker_id
        self.role = role
        self.ns = spec.namespace
        self._new_store = store_factory  # one client per thread: TCPStore clients are not shared
        self._local = threading.local()
        self.layerwise_min_tokens = spec.layerwise_min_tokens
        self.num_layers, self.block_size = kv_cache.shape[0], kv_cache.shape[3]
        self.plane_block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.bytes_per_block = 2 * self.num_layers * self.plane_block_bytes
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._dead: dict[str, str] = {}
        self._pairs: dict[str, Pair] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self._liveness: dict[str, tuple[int, float]] = {}
        self._records: deque[dict] = deque(maxlen=1024)
        self._totals = {"transfers": 0, "bytes": 0, "seconds": 0.0, "failures": 0}
        self._bundle_ids = itertools.count()
        # decode side
        self._pending: dict[tuple[str, int], _Expect] = {}
        self._arrivals: deque[KVArrival] = deque()
        self._in_flight: list[_InBundle] = []
        self._done_keys: deque[str] = deque()
        self._wakeup: Callable[[], None] | None = None
        store = self._store()
        self.incarnation = int(store.add(f"{self.ns}/inc/{worker_id}", 1))
        store.set(f"{self.ns}/hb/{worker_id}", b"0")  # a new life (a clean close left it negative)
        self._setup_payload()
        self._inbox: Inbox | None = None
        self._control: threading.Thread | None = None
        if role == "decode":
            host = None
            if spec.store_host:
                host = spec.bind_host or local_address_towards(spec.store_host, spec.store_port)
            self._inbox = Inbox(host, f"{self.ns}/{worker_id}")
            info = {"endpoint": self._inbox.endpoint, "layout": self._layout(), "pid": os.getpid(),
                    "incarnation": self.incarnation, **self._payload_info()}
            store.set(f"{self.ns}/ctl/{worker_id}", msgspec.msgpack.encode(info))
            self._control = threading.Thread(target=self._control_loop, name=f"kv-control-{worker_id}", daemon=True)
            self._control.start()
        self._heartbeat = threading.Thread(target=self._beat, name=f"kv-heartbeat-{worker_id}", daemon=True)
        self._heartbeat.start()
        _LIVE.add(self)

    # -- payload hooks ----------------------------------------------------------------------------
    def _setup_payload(self) -> None:
        """Per-transport payload state (before any thread starts)."""

    def _payload_info(self) -> dict:
        """Decode side: extras published with the control endpoint."""
        return {}

    @abstractmethod
    def _plan(self, srcs: list[tuple[int, ...]], dsts: list[tuple[int, ...]], layerwise: bool) -> tuple[list[ItemPlan], list[Launch]]:
        """The bundle's items and launches; both sides must compute the same."""

    @abstractmethod
    def _payload_prepare(self, pair: Pair, info: dict) -> list[bytes]:
        """Prefill, connecting: per-pair state from the decode side's info; returns the doorbell
        events' IPC handles the hello carries (same-GPU), or none."""

    @abstractmethod
    def _payload_warm(self, pair: Pair) -> None:
        """Prefill, after the hello: form the channel and move one tiny transfer through it."""

    @abstractmethod
    def _payload_accept(self, pair: Pair, hello: Hello) -> None:
        """Decode, on a hello: form the channel and take the tiny transfer."""

    @abstractmethod
    def _payload_issue(self, pair: Pair, b: _OutBundle, launch: Launch, ready) -> None:
        """Prefill: enqueue one launch once `ready` (an event on the compute stream, or None)."""

    @abstractmethod
    def _payload_seal(self, pair: Pair, b: _OutBundle) -> tuple[Completion, int]:
        """Prefill, after the last launch: the bundle's completion, and the doorbell event the commit
        names (same-GPU; else -1)."""

    @abstractmethod
    def _payload_post(self, pair: Pair, b: _InBundle) -> tuple[Completion, str | None]:
        """Decode: post the whole bundle's receives; the completion covers whatever was posted, with
        an error if posting failed part way."""

    def _payload_commit(self, pair: Pair, b: _InBundle, msg: Commit) -> None:
        """Decode: the commit arrived (same-GPU binds the completion event it names)."""

    @abstractmethod
    def _payload_abort(self, pair: Pair) -> None:
        """Tear down the pair's channel so nothing in flight can still complete or write."""

    def _payload_mark(self):
        """A CUDA event on the current (compute) stream: the KV enqueued so far is ready then."""
        if not self.kv_cache.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.kv_cache.device))
        return ev

    # -- helpers ------------------------------------------------------------------------------------
    def _layout(self) -> list:
        c = self.kv_cache
        return [c.shape[0], c.shape[3], c.shape[4], c.shape[5], str(c.dtype).removeprefix("torch.")]

    def _store(self):
        s = getattr(self._local, "store", None)
        if s is None:
            s = self._local.store = self._new_store()
        return s

    def _key(self, prefill: str, decode: str, decode_inc: int, seq: int) -> str:
        return f"{self.ns}/x/{prefill}/{decode}.{decode_inc}/{seq}"

    def _wake(self) -> None:
        w = self._wakeup
        if w is not None:
            w()

    def _beat(self) -> None:
        store, key = self._new_store(), f"{self.ns}/hb/{self.worker_id}"
        while not self._closed.is_set():
            try:
                store.add(key, 1)
            except Exception:  # store gone: peers will see us as silent, which is the truth
                pass
            if self.role == "prefill":
                try:
                    self._watch_outgoing(store)
                except Exception:  # noqa: BLE001
                    log.exception("watching KV transfers failed")
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
                # (v == 0: the peer never started its transport; only deadlines judge it)
                raise PeerDeadError(f"peer {peer} silent for {now - since:.1f}s (no heartbeat within "
                                    f"peer_timeout_s={self.spec.peer_timeout_s}): presumed dead")

    def _wait_key(self, store, key: str, peer: str, deadline: float, what: str) -> bytes | None:
        """Connecting only (never on a transfer's path): polls until `key` exists; None at the deadline;
        raises if the peer died meanwhile."""
        delay, next_live = 1e-4, 0.0
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
            delay = min(delay * 2, 0.05)

    def _mark_dead(self, peer: str, why: str) -> None:
        """Any thread. Fails every transfer with the peer, each once nothing can write its blocks."""
        with self._lock:
            if peer in self._dead:
                return
            self._dead[peer] = why
            pair = self._pairs.get(peer)
            bundles = list(pair.bundles) if pair is not None else []
        log.warning("KV transport %s: peer %s is dead: %s", self.worker_id, peer, why)
        if pair is not None:
            pair.dead = why
            for b in bundles:  # decided before the abort: a bundle already complete landed intact
                intact = b.completion is not None and b.completion.done() and b.completion.error() is None
                if not intact or (isinstance(b, _InBundle) and not b.committed):  # it needs its first token too
                    b.failed = f"PeerDeadError: {why}"
            with pair.io:
                try:
                    self._payload_abort(pair)
                except Exception:  # noqa: BLE001
                    log.exception("aborting the KV channel to %s failed", peer)
            for b in bundles:
                if b.completion is not None:
                    b.completion.abandon()
        if self._inbox is not None:
            self._inbox.wake()  # the control thread fails the peer's pending transfers
        self._wake()

    def peer_died(self, peer: str, why: str) -> None:
        """The caller knows the peer is dead (Ray said so): fail everything with it now."""
        self._mark_dead(peer, why)

    def _forget_incarnation(self, peer: str, why: str) -> None:
        """Control thread or connect(): a new incarnation of `peer` shows up. Everything with the old
        one fails now (its pair's bundles, and on the decode side the transfers it was expected to
        send: their blocks come back), then the peer counts as alive again."""
        with self._lock:
            known = peer in self._pairs or peer in self._dead
        if not known:
            return
        self._mark_dead(peer, f"peer {peer} {why}")
        if self._inbox is not None:
            self._fail_pending_of(peer)
        with self._lock:
            self._dead.pop(peer, None)
            self._liveness.pop(peer, None)
            old = self._pairs.pop(peer, None)
        if old is not None:
            old.waiter.stop()
            if old.outbox is not None:
                old.outbox.close()

    def _fail_pending_of(self, peer: str) -> None:
        """Decode side: the transfers still expected from a dead incarnation of `peer` fail now."""
        store = self._store()
        with self._lock:
            due = [e for e in self._pending.values() if e.peer == peer]
        why = self._dead.get(peer, "its incarnation ended")
        for e in due:
            res = e.reservation
            key = self._key(e.peer, self.worker_id, self.incarnation, res.transfer_seq)
            v = store.compare_set(key, "", CANCEL)
            with self._lock:
                if self._pending.pop((e.peer, res.transfer_seq), None) is not e:
                    continue
            if v != CANCEL:  # claimed by the dead incarnation: no receive was posted, nothing can land
                self._done_keys.append(key)
            self._record("recv", res.request_id, 0, 0.0, False, e.peer)
            self._arrive(KVArrival(res, None, TransferStats(0, 0.0), error=f"PeerDeadError: {why}"))

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

    # -- prefill side: pairs --------------------------------------------------------------------------
    def connect(self, decode_worker_ids: Sequence[str]) -> dict[str, float]:
        out = {}
        store = self._store()
        for peer in sorted(set(decode_worker_ids)):  # the same order everywhere: see _pair
            t0 = time.perf_counter()
            raw = store.get(f"{self.ns}/ctl/{peer}") if store.check([f"{self.ns}/ctl/{peer}"]) else None
            inc = msgspec.msgpack.decode(raw).get("incarnation", 0) if raw is not None else None
            with self._lock:
                pair = self._pairs.get(peer)
                # A dead peer that has not published a new incarnation stays dead (_pair raises).
                stale = inc is not None and (pair.peer_inc != inc if pair is not None else peer in self._dead)
            if stale:  # the decode worker restarted: form the pair with its new incarnation
                self._forget_incarnation(peer, f"published incarnation {inc}")
            self._pair(peer)
            out[peer] = time.perf_counter() - t0
        return out

    def _pair(self, peer: str) -> Pair:
        """The pair with this decode worker, formed and warmed on first use.

        The decode side forms its half on our hello, from its control thread, one hello at a time; a
        prefill forms one pair at a time. So a decode worker only ever waits for a prefill worker that
        is forming a pair with it: no cycle, whatever the order of hellos."""
        with self._lock:
            pair = self._pairs.get(peer)
            lock = self._pair_locks.setdefault(peer, threading.Lock())
        if pair is None:
            with lock:
                with self._lock:
                    pair = self._pairs.get(peer)
                if pair is None:
                    pair = self._open_pair(peer)
        if pair.dead is not None:
            raise PeerDeadError(f"peer {peer} is marked dead: {pair.dead}")
        return pair

    def _open_pair(self, peer: str) -> Pair:
        """Any failure leaves the peer dead: its half of the channel may exist, ours never will."""
        if peer in self._dead:
            raise PeerDeadError(f"peer {peer} is marked dead: {self._dead[peer]}")
        pair = Pair(peer, self.worker_id)
        try:
            raw = self._wait_key(self._store(), f"{self.ns}/ctl/{peer}", peer,
                                 time.monotonic() + self.spec.transfer_timeout_s, "its KV control endpoint")
            if raw is None:
                raise TimeoutError(f"decode worker {peer} never published its KV control endpoint "
                                   f"(within transfer_timeout_s={self.spec.transfer_timeout_s})")
            info = msgspec.msgpack.decode(raw)
            pair.peer_inc = info.get("incarnation", 0)
            if list(info["layout"]) != self._layout():
                raise RuntimeError(f"KV layout mismatch with {peer}: its pool is {info['layout']} "
                                   f"([layers, block_size, kv_heads, head_dim, dtype]), this cache {self._layout()}")
            pair.outbox = Outbox(info["endpoint"])
            events = self._payload_prepare(pair, info)
            pair.outbox.send(Hello(self.worker_id, self._layout(), events, self.incarnation))
            with pair.io:
                self._payload_warm(pair)
        except Exception as e:
            if pair.outbox is not None:
                pair.outbox.close()
            with self._lock:
                self._dead.setdefault(peer, f"connecting failed: {type(e).__name__}: {e}")
            raise
        pair.waiter.start()
        with self._lock:
            self._pairs[peer] = pair
        return pair

    # -- prefill side: shipments --------------------------------------------------------------------
    def begin(self, sends: Sequence[KVSend], layerwise: bool | None = None) -> Shipment:
        sh = _Shipment(self)
        groups: dict[str, list[KVSend]] = {}
        for s in sends:
            sh.futures[s.reservation.request_id] = Future()
            groups.setdefault(s.reservation.decode_worker_id, []).append(s)
        store = self._store()
        for peer in sorted(groups):  # pair locks in one order: concurrent shipments can't deadlock
            todo = groups[peer]
            try:
                pair = self._pair(peer)
            except Exception as e:  # noqa: BLE001 - the peer's transfers fail, the rest go on
                for s in todo:
                    self._fail_send(sh.futures[s.reservation.request_id], s, e, peer)
                continue
            pair.order.acquire()
            try:
                b = self._open_bundle(store, pair, todo, sh.futures, layerwise)
            except Exception as e:  # noqa: BLE001 - claims may stand that the decode side never hears of
                pair.order.release()
                for s in todo:
                    if not sh.futures[s.reservation.request_id].done():
                        self._fail_send(sh.futures[s.reservation.request_id], s, e, peer)
                self._mark_dead(peer, f"opening a KV bundle failed: {type(e).__name__}: {e}")
                continue
            if b is None:
                pair.order.release()
            else:
                sh.bundles.append(b)
        return sh

    def _check_send(self, s: KVSend) -> None:
        res, n = s.reservation, len(s.src_block_ids)
        if res.decode_worker_id == self.worker_id:
            raise ValueError("a KV transfer to itself")
        if not 0 < n <= len(res.block_ids):
            raise ValueError(f"{n} source blocks for a reservation of {len(res.block_ids)}")
        if -(-s.num_tokens // self.block_size) != n:
            raise ValueError(f"{s.num_tokens} tokens do not fill {n} blocks of {self.block_size}")

    def _claim(self, store, pair: Pair, res: Reservation, value: bytes) -> None:
        key = self._key(self.worker_id, res.decode_worker_id, pair.peer_inc, res.transfer_seq)
        got = store.compare_set(key, "", value)
        if got == CANCEL:
            store.delete_key(key)
            raise TimeoutError(f"decode worker {res.decode_worker_id} gave up on transfer {res.transfer_seq} "
                               f"({res.request_id}) before it was sent (expect_timeout_s={self.spec.expect_timeout_s} "
                               "or cancelled); its blocks are back in its pool")
        if got != value:
            raise RuntimeError(f"transfer {res.transfer_seq} to {res.decode_worker_id} was already claimed")

    def _fail_send(self, fut: Future, s: KVSend, e: BaseException, peer: str) -> None:
        self._record("send", s.reservation.request_id, 0, 0.0, False, peer)
        fut.set_exception(e)

    def _open_bundle(self, store, pair: Pair, todo: list[KVSend], futures, layerwise) -> _OutBundle | None:
        """Under pair.order: claims, plans and announces one bundle (None if nothing was claimed)."""
        claimed = []
        for s in todo:
            fut = futures[s.reservation.request_id]
            try:
                self._check_send(s)
                self._claim(store, pair, s.reservation, CLAIM)
            except Exception as e:  # noqa: BLE001
                self._fail_send(fut, s, e, pair.peer)
                continue
            claimed.append(s)
        if not claimed:
            return None
        lw = layerwise if layerwise is not None else sum(s.num_tokens for s in claimed) >= self.layerwise_min_tokens
        srcs = [tuple(s.src_block_ids) for s in claimed]
        items, launches = self._plan(srcs, [tuple(s.reservation.block_ids[:len(x)]) for s, x in zip(claimed, srcs)], lw)
        b = _OutBundle(next(self._bundle_ids), pair, claimed, [futures[s.reservation.request_id] for s in claimed],
                       items, launches)
        msg = Begin(self.worker_id, b.id, lw, fingerprint(items, launches),
                    [(s.reservation.transfer_seq, s.reservation.request_id, s.num_tokens,
                      np.asarray(x, dtype="<i4").tobytes()) for s, x in zip(claimed, srcs)])
        with self._lock:
            pair.bundles.append(b)
        try:
            pair.outbox.send(msg)
        except Exception as e:  # noqa: BLE001 - the decode side never hears of these claims
            self._mark_dead(pair.peer, f"pushing a begin failed: {e}")
        return b

    def _issue_through(self, b: _OutBundle, layer: int | None, ready) -> None:
        """Issues b's launches whose layers are all computed (every one when layer is None)."""
        pair = b.pair
        while b.issued < len(b.launches) and (layer is None or launch_last_layer(b.launches[b.issued]) <= layer):
            if pair.dead is not None or b.failed is not None:
                b.issued = len(b.launches)  # the channel is gone: nothing more can be sent
                break
            try:
                with pair.io:
                    self._payload_issue(pair, b, b.launches[b.issued], ready)
            except Exception as e:  # noqa: BLE001 - the pair's sends and receives no longer match
                b.failed = f"{type(e).__name__}: {e}"
                self._mark_dead(pair.peer, f"issuing a KV launch failed: {b.failed}")
                b.issued = len(b.launches)
                break
            b.issued += 1
        if b.issued == len(b.launches) and not b.unlocked:
            b.unlocked = True
            pair.order.release()

    def _seal(self, b: _OutBundle) -> None:
        b.t_kv = time.monotonic()
        try:
            with b.pair.io:
                b.completion, b.commit_event = self._payload_seal(b.pair, b)
        except Exception as e:  # noqa: BLE001
            b.failed = b.failed or f"{type(e).__name__}: {e}"
            b.completion = ReadyCompletion()
            self._mark_dead(b.pair.peer, f"sealing a KV bundle failed: {b.failed}")

    def _commit(self, b: _OutBundle, first_tokens: Mapping[str, int | None],
                logprobs: Mapping[str, PrefillLogprobs]) -> None:
        toks = [first_tokens.get(s.reservation.request_id) for s in b.sends]
        lps = [logprobs.get(s.reservation.request_id) for s in b.sends] if logprobs else []
        msg = Commit(self.worker_id, b.id, [-1 if t is None else int(t) for t in toks], [t is not None for t in toks],
                     b.commit_event, lps if any(lp is not None for lp in lps) else [])
        if b.pair.dead is None:
            try:
                b.pair.outbox.send(msg)
            except Exception as e:  # noqa: BLE001
                self._mark_dead(b.pair.peer, f"pushing a commit failed: {e}")
        b.pair.waiter.put(b.completion, lambda: self._finish_out(b))

    def _finish_out(self, b: _OutBundle) -> None:
        """Waiter thread: this side's payload is done (or the pair died): resolve the futures."""
        seconds = time.monotonic() - b.t_kv
        err = b.failed or b.completion.error()
        if err is not None:
            self._mark_dead(b.pair.peer, f"a KV payload failed: {err}")
        with self._lock:
            if b in b.pair.bundles:
                b.pair.bundles.remove(b)
        for s, fut in zip(b.sends, b.futures):
            rid = s.reservation.request_id
            if err is not None:
                self._record("send", rid, 0, seconds, False, b.pair.peer)
                exc = PeerDeadError if "PeerDeadError" in err else RuntimeError
                fut.set_exception(exc(f"KV transfer {s.reservation.transfer_seq} ({rid}) to {b.pair.peer} failed: {err}"))
            else:
                fut.set_result(self._record("send", rid, len(s.src_block_ids) * self.bytes_per_block, seconds, True,
                                            b.pair.peer))

    def _watch_outgoing(self, store) -> None:
        """Heartbeat thread: a peer with transfers in flight must stay alive and finish them in time."""
        now = time.monotonic()
        with self._lock:
            busy = [(p, list(p.bundles)) for p in self._pairs.values() if p.bundles and p.dead is None]
        for pair, bundles in busy:
            try:
                self._check_alive(store, pair.peer)
            except PeerDeadError as e:
                self._mark_dead(pair.peer, str(e))
                continue
            for b in bundles:
                if b.t_kv and b.completion is not None and not b.completion.done() \
                        and now - b.t_kv > self.spec.transfer_timeout_s:
                    self._mark_dead(pair.peer, f"a KV payload was not done within transfer_timeout_s="
                                               f"{self.spec.transfer_timeout_s}")
                    break

    def send_abort(self, reservation: Reservation, request_id: str, timeout_s: float) -> None:
        if reservation.request_id != request_id:
            raise ValueError(f"abort of {request_id} for the reservation of {reservation.request_id}")
        pair = self._pair(reservation.decode_worker_id)
        self._claim(self._store(), pair, reservation, ABORT)
        pair.outbox.send(Abort(self.worker_id, reservation.transfer_seq, request_id))
        self._record("send", request_id, 0, 0.0, True, pair.peer)

    # -- decode side --------------------------------------------------------------------------------
    def _on_stream(self, stream):
        """Makes a pair's CUDA stream current, on the cache's device; nothing without one (CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.kv_cache.device))
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._wakeup = wake

    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        key = (prefill_worker_id, reservation.transfer_seq)
        with self._lock:
            if key in self._pending:
                raise ValueError(f"transfer {reservation.transfer_seq} from {prefill_worker_id} is already expected")
            self._pending[key] = _Expect(reservation, prefill_worker_id, time.monotonic() + self.spec.expect_timeout_s)
            dead = prefill_worker_id in self._dead
        if dead:
            self._inbox.wake()  # fails it right away

    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        with self._lock:
            e = self._pending.get((prefill_worker_id, reservation.transfer_seq))
            if e is None or e.reservation != reservation or e.state != "waiting":
                return  # claimed, in flight or arrived already (it lands or fails), or never expected
            e.cancel = True
        self._inbox.wake()

    def poll_arrivals(self) -> list[KVArrival]:
        out: list[KVArrival] = []
        with self._lock:
            while self._arrivals:
                out.append(self._arrivals.popleft())
            done = [b for b in self._in_flight if (b.committed or b.failed) and b.completion.done()]
            for b in done:
                self._in_flight.remove(b)
                b.pair.bundles.remove(b)
        for b in done:
            out += self._bundle_arrivals(b)
        return out

    def _bundle_arrivals(self, b: _InBundle) -> list[KVArrival]:
        seconds = time.monotonic() - b.t_begin
        err = b.failed or b.completion.error()
        out = []
        for k, e in enumerate(b.expects):
            res = e.reservation
            self._done_keys.append(self._key(b.pair.peer, self.worker_id, self.incarnation, res.transfer_seq))
            n = len(b.items[k].src)
            header = None
            if b.committed:
                header = KVHeader(res.request_id, res.transfer_seq, b.num_tokens[k], b.tokens[k], ok=b.oks[k],
                                  logprobs=b.logprobs[k] if b.logprobs else None)
            why = err or (None if header.ok else "prefill aborted or failed")
            if why is None:
                out.append(KVArrival(res, header, self._record("recv", res.request_id, n * self.bytes_per_block, seconds,
                                                               True, b.pair.peer)))
            else:
                self._record("recv", res.request_id, 0, seconds, False, b.pair.peer)
                out.append(KVArrival(res, header if err is None else None, TransferStats(0, seconds), error=why))
        return out

    def _arrive(self, arrival: KVArrival) -> None:
        with self._lock:
            self._arrivals.append(arrival)
        self._wake()

    def _control_loop(self) -> None:
        if self.kv_cache.is_cuda:
            torch.cuda.set_device(self.kv_cache.device)
        store = self._store()
        next_live = 0.0
        while not self._closed.is_set():
            try:
                msgs = self._inbox.recv(self._next_timeout())
            except Exception:  # noqa: BLE001 - the inbox closed under us
                if self._closed.is_set():
                    return
                raise
            for m in msgs:
                try:
                    self._handle(m)
                except Exception as e:  # noqa: BLE001 - the pair's state is unknown now
                    log.exception("KV control message %s from %s failed", type(m).__name__, m.p)
                    self._mark_dead(m.p, f"protocol error on {type(m).__name__}: {type(e).__name__}: {e}")
            try:
                self._run_deadlines(store)
                if time.monotonic() >= next_live:
                    self._check_peers(store)
                    next_live = time.monotonic() + self.spec.heartbeat_s
                while self._done_keys:
                    store.delete_key(self._done_keys.popleft())
            except Exception:  # noqa: BLE001 - the store is gone (shutting down); retry next round
                if self._closed.is_set():
                    return
                log.exception("KV control round failed")
                self._closed.wait(self.spec.heartbeat_s)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        with self._lock:
            soonest = min((e.deadline for e in self._pending.values()), default=now + self.spec.heartbeat_s)
        return max(0.0, min(self.spec.heartbeat_s, soonest - now))

    def _handle(self, m: Message) -> None:
        peer = m.p
        if isinstance(m, Hello):
            if list(m.layout) != self._layout():
                raise RuntimeError(f"KV layout mismatch: {peer} has {m.layout}, this pool {self._layout()}")
            self._forget_incarnation(peer, f"it restarted (incarnation {m.inc})")
            pair = Pair(peer, self.worker_id)
            pair.peer_inc = m.inc
            with pair.io:
                self._payload_accept(pair, m)
            pair.waiter.start()
            with self._lock:
                self._pairs[peer] = pair
            return
        with self._lock:
            pair = self._pairs.get(peer)
        if pair is None:
            raise RuntimeError(f"{type(m).__name__} from {peer} before its hello")
        if pair.dead is not None:
            return  # everything of a dead peer has failed already; its late messages change nothing
        if isinstance(m, Begin):
            self._on_begin(pair, m)
        elif isinstance(m, Commit):
            self._on_commit(pair, m)
        else:
            self._on_abort(pair, m)

    def _on_begin(self, pair: Pair, m: Begin) -> None:
        peer, entries = pair.peer, m.items
        srcs = [tuple(np.frombuffer(src, dtype="<i4").tolist()) for _, _, _, src in entries]
        with self._lock:
            expects = [self._pending.get((peer, seq)) for seq, *_ in entries]
        for e, (seq, rid, ntok, _), src in zip(expects, entries, srcs):
            if e is None or e.reservation.request_id != rid:
                raise RuntimeError(f"begin of transfer {seq} ({rid}) that is not expected from {peer}")
            if not 0 < len(src) <= len(e.reservation.block_ids) or -(-ntok // self.block_size) != len(src):
                raise RuntimeError(f"transfer {seq}: {len(src)} blocks for {ntok} tokens into {len(e.reservation.block_ids)}")
        items, launches = self._plan(srcs, [tuple(e.reservation.block_ids[:len(s)]) for e, s in zip(expects, srcs)],
                                     m.layerwise)
        if fingerprint(items, launches) != m.fingerprint:
            raise RuntimeError("the bundle's plan differs between prefill and decode (mismatched code?)")
        b = _InBundle(m.b, pair, expects, [x[2] for x in entries], items, launches, time.monotonic())
        with self._lock:
            for e in expects:
                del self._pending[(peer, e.reservation.transfer_seq)]
            pair.bundles.append(b)
            self._in_flight.append(b)
        with pair.io:
            b.completion, err = self._payload_post(pair, b)
        if err is not None:
            b.failed = f"posting receives failed: {err}"
            self._mark_dead(peer, b.failed)
        pair.waiter.put(b.completion, lambda: self._landed(b))

    def _landed(self, b: _InBundle) -> None:
        """Waiter thread: the bundle's payload is done; a failed one means the pair is broken."""
        err = b.completion.error()
        if err is not None:
            self._mark_dead(b.pair.peer, f"a KV payload failed: {err}")
        self._wake()

    def _on_commit(self, pair: Pair, m: Commit) -> None:
        with self._lock:
            b = next((x for x in pair.bundles if x.id == m.b), None)
        if (b is None or len(m.tokens) != len(b.expects) or len(m.ok) != len(b.expects)
                or len(m.logprobs) not in (0, len(b.expects))):
            raise RuntimeError(f"commit of bundle {m.b} that is not in flight (or not of its size)")
        self._payload_commit(pair, b, m)
        with self._lock:
            b.tokens, b.oks, b.logprobs, b.committed = list(m.tokens), list(m.ok), list(m.logprobs), True
        self._wake()

    def _on_abort(self, pair: Pair, m: Abort) -> None:
        with self._lock:
            e = self._pending.pop((pair.peer, m.seq), None)
        if e is None or e.reservation.request_id != m.request_id:
            raise RuntimeError(f"abort of transfer {m.seq} ({m.request_id}) that is not expected")
        res = e.reservation
        self._done_keys.append(self._key(pair.peer, self.worker_id, self.incarnation, res.transfer_seq))
        self._record("recv", res.request_id, 0, 0.0, True, pair.peer)
        self._arrive(KVArrival(res, KVHeader(res.request_id, res.transfer_seq, 0, -1, ok=False), TransferStats(0, 0.0),
                               error="prefill aborted or failed"))

    def _run_deadlines(self, store) -> None:
        """Control thread: expect deadlines, cancels, and the pending transfers of dead peers."""
        now = time.monotonic()
        with self._lock:
            due = [e for e in self._pending.values()
                   if e.peer in self._dead or e.deadline <= now or (e.cancel and e.state == "waiting")]
            stalled = [b for b in self._in_flight if not b.failed and now - b.t_begin > self.spec.transfer_timeout_s
                       and (not b.committed or not b.completion.done())]
        for e in due:
            res, dead = e.reservation, self._dead.get(e.peer)
            if e.state == "claimed" and dead is None:
                self._mark_dead(e.peer, f"transfer {res.transfer_seq} was claimed but no KV came within "
                                        f"transfer_timeout_s={self.spec.transfer_timeout_s}")
                dead = self._dead[e.peer]
            key = self._key(e.peer, self.worker_id, self.incarnation, res.transfer_seq)
            v = store.compare_set(key, "", CANCEL)
            if v != CANCEL and dead is None:
                with self._lock:  # claimed meanwhile: its begin (or abort) is on the way
                    e.state, e.deadline, e.cancel = "claimed", now + self.spec.transfer_timeout_s, False
                continue
            with self._lock:
                if self._pending.get((e.peer, res.transfer_seq)) is not e:
                    continue  # its begin or abort arrived meanwhile
                del self._pending[(e.peer, res.transfer_seq)]
            if v != CANCEL:  # claimed by a peer now dead: no receive was posted, nothing can land
                self._done_keys.append(key)
            if dead is not None:
                why = f"PeerDeadError: peer {e.peer} is marked dead: {dead}"
            elif e.cancel:
                why = "cancelled by the decode worker"
            else:
                why = f"TimeoutError: no KV from {e.peer} within expect_timeout_s={self.spec.expect_timeout_s}"
            self._record("recv", res.request_id, 0, 0.0, False, e.peer)
            self._arrive(KVArrival(res, None, TransferStats(0, 0.0), error=why))
        for b in stalled:
            self._mark_dead(b.pair.peer, f"a KV bundle was not {'done' if b.committed else 'committed'} within "
                                         f"transfer_timeout_s={self.spec.transfer_timeout_s}")

    def _check_peers(self, store) -> None:
        with self._lock:
            peers = {e.peer for e in self._pending.values()} | {b.pair.peer for b in self._in_flight}
            peers -= set(self._dead)
        for peer in sorted(peers):
            try:
                self._check_alive(store, peer)
            except PeerDeadError as e:
                self._mark_dead(peer, str(e))

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._inbox is not None:
            self._inbox.wake()
            self._control.join(timeout=5)
        self._heartbeat.join(timeout=5)
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.waiter.stop()
            if pair.outbox is not None:
                pair.outbox.close()
        if self._inbox is not None:
            self._inbox.close()
        try:
            self._new_store().set(f"{self.ns}/hb/{self.worker_id}", b"-1000000000")
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
