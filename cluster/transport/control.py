"""The control plane every KV transport shares; how the payload moves is a subclass's (torch_dist.py:
NCCL/gloo point-to-point, same_gpu.py: CUDA IPC copies).

The store (the launcher's TCPStore, or an in-process HashStore in tests) holds ownership and liveness
only, never anything a transfer waits for. Every value in it is sealed under the cluster's secret
(authenticated_store.py: the MAC binds the value to its key, and each key names its writer and the
writer's incarnation); a value that does not verify is never used:
  {ns}/x/P/D.i/s the claim of transfer s from prefill P to incarnation i of decode D. The prefill claims with
                 compare_set("", CLAIM) (ABORT: a transfer that carries no KV) before any byte can
                 reach the reserved blocks; the decode side cancels with compare_set("", CANCEL) when
                 its expect deadline passes or it is asked to. Exactly one wins, atomically: after a
                 cancel nothing lands. The decode side deletes a claim once the transfer arrived; the
                 prefill deletes a CANCEL it read.
  {ns}/hb/W      W's heartbeat record [incarnation, count], rewritten every heartbeat_s (-1e9 after a
                 clean close); a forged or replayed one is no news (heartbeat_records.py).
  {ns}/inc/W     W's incarnation counter: each transport a worker starts takes the next number (never
                 one at or below its own last record's). Peers read incarnations from the records.
  {ns}/verdict/P.i/D.j/gG  decode D's answer to prefill P's hello for pair generation G ("ok", or why it
                 refuses the pair), read
                 and deleted by P before it forms its half of the payload channel (pair.py).
  {ns}/ctl/D     decode worker D's control endpoint, incarnation, PlanSpec (plan.py: KV layout and payload,
                 which the prefill's must equal) and payload extras (its IPC pool).
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
on the pair's own CUDA stream at once (gloo: its pair's waiter thread, a staging slot at a time;
torch_dist.py). Each launch of the plan is issued on the prefill's pair stream
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

The code. `ControlledTransport` (here) is what both roles share: the store and the incarnation, the
pairs and the dead peers under one lock, liveness, marking a peer dead, the records, the threads, and
the payload hooks a subclass implements (payload_hooks.py). Like vLLM's KV connectors (one object per role, the connector
delegating to it), it holds the side of its role: a prefill transport a `SenderSide` (sender_side.py),
a decode transport a `ReceiverSide` (receiver_side.py) that its control thread feeds; a call of the
other role raises. The sides import pair.py (Pair, PeerDeadError, claim keys); this file only for types.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import torch

from cluster.messages import Reservation
from cluster.transport.base import KVArrival, KVSend, KVTransport, Shipment, TransferStats
from cluster.transport.channel import Inbox
from cluster.transport.heartbeat_records import CLOSED, HeartbeatRecords
from cluster.transport.pair import Pair, PeerDeadError, down_key
from cluster.transport.payload_hooks import PayloadHooks
from cluster.transport.plan import KVNumerics, PlanSpec
from cluster.transport.receiver_side import ReceiverSide
from cluster.transport.rendezvous_store import local_address_towards
from cluster.transport.sender_side import SenderSide

log = logging.getLogger(__name__)

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


class ControlledTransport(PayloadHooks, KVTransport):
    """Claims, cancels, heartbeats, the push channel, deadlines, completions and metrics. Subclasses
    implement the `_payload_*` hooks (payload_hooks.py); the sides call them with `pair.io` held where
    they touch a channel.

    For the two sides: `lock` guards `pairs`, `dead_peers` and every bundle list; `store()` is this
    thread's store client; `check_alive`, `mark_dead`, `forget_incarnation` and `record` are shared."""

    def __init__(self, spec, kv_cache: torch.Tensor, worker_id: str, role: str, store_factory,
                 tp: tuple[int, int] | None = None, numerics: KVNumerics | None = None):
        """tp: (ranks of this worker's tensor-parallel group, the model's KV heads) when this transport is
        its rank 0 (tp_payload.py); None: one process holds every head (kv_cache's).
        numerics: what the cache's K/V is (plan.KVNumerics); a pair whose two sides differ is refused."""
        assert role in ("prefill", "decode"), role
        self.spec = spec
        self.numerics = numerics
        self.kv_cache = kv_cache
        self.worker_id = worker_id
        self.role = role
        self.ns = spec.namespace
        self._new_store = store_factory  # one client per thread: TCPStore clients are not shared
        self._local = threading.local()
        self.layerwise_min_tokens = spec.layerwise_min_tokens
        self.num_layers, self.block_size = kv_cache.shape[0], kv_cache.shape[3]
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.dead_peers: dict[str, str] = {}
        self.pairs: dict[str, Pair] = {}
        self._liveness: dict[str, tuple[int, float]] = {}
        self._records: deque[dict] = deque(maxlen=1024)
        self._totals = {"transfers": 0, "bytes": 0, "seconds": 0.0, "failures": 0}
        self.faults: list[tuple[str, float]] = []  # inject_fault(): armed, not fired yet
        self.faults_fired = 0
        self.fired: deque[dict] = deque(maxlen=64)  # the faults that fired: kind, peer, pair generation
        store = self.store()
        self.beats = HeartbeatRecords(self.ns, worker_id)
        self.incarnation = self.beats.allocate(store)  # a new life (a clean close left it negative)
        self._setup_payload()
        payload, chunk_bytes = self._payload_plan()
        c = kv_cache
        tp_size, kv_heads = tp if tp is not None else (1, c.shape[4])
        self.tp_rank = 0  # this transport's rank in its worker's group: rank 0 drives the control plane
        # This side's own spec: the peer's tensor-parallel size is 1 until a pair joins both (PlanSpec.joined).
        self.plan_spec = PlanSpec(payload, c.shape[0], c.shape[3], kv_heads, c.shape[5],
                                  str(c.dtype).removeprefix("torch."), c.element_size(), chunk_bytes,
                                  prefill_tp=tp_size if role == "prefill" else 1,
                                  decode_tp=tp_size if role == "decode" else 1)
        self.plane_block_bytes = self.plan_spec.plane_block_bytes
        self.bytes_per_block = self.plan_spec.block_bytes
        self.sender: SenderSide | None = None
        self.receiver: ReceiverSide | None = None
        self._inbox: Inbox | None = None
        self._control: threading.Thread | None = None
        if role == "decode":
            host = None
            if spec.store_host:
                host = spec.bind_host or local_address_towards(spec.store_host, spec.store_port)
            self._inbox = Inbox(host, f"{self.ns}/{worker_id}", spec.secret, receiver=f"{worker_id}.{self.incarnation}")
            self.receiver = ReceiverSide(self, self._inbox)
            info = {"endpoint": self._inbox.endpoint, "layout": self.plan_spec.to_wire(), "pid": os.getpid(),
                    "incarnation": self.incarnation, "numerics": numerics.as_dict() if numerics else None,
                    **self._payload_info()}
            self.beats.keep(store, f"{self.ns}/ctl/{worker_id}", msgspec.msgpack.encode(info))
            self._control = threading.Thread(target=self._control_loop, name=f"kv-control-{worker_id}", daemon=True)
            self._control.start()
        else:
            self.sender = SenderSide(self)
        self._heartbeat = threading.Thread(target=self._beat, name=f"kv-heartbeat-{worker_id}", daemon=True)
        self._heartbeat.start()
        _LIVE.add(self)

    # -- KVTransport: each call goes to the side of this transport's role -------------------------
    def _sending(self) -> SenderSide:
        if self.sender is None:
            raise RuntimeError(f"the KV transport of {self.worker_id} is a {self.role} worker's: it sends no KV")
        return self.sender

    def _receiving(self) -> ReceiverSide:
        if self.receiver is None:
            raise RuntimeError(f"the KV transport of {self.worker_id} is a {self.role} worker's: it receives no KV")
        return self.receiver

    def connect(self, decode_worker_ids: Sequence[str]) -> dict[str, float]:
        return self._sending().connect(decode_worker_ids)

    def begin(self, sends: Sequence[KVSend], layerwise: bool | None = None) -> Shipment:
        return self._sending().begin(sends, layerwise)

    def send_abort(self, reservation: Reservation, request_id: str, timeout_s: float) -> None:
        self._sending().send_abort(reservation, request_id, timeout_s)

    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        self._receiving().expect(reservation, prefill_worker_id)

    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        self._receiving().cancel(reservation, prefill_worker_id)

    def poll_arrivals(self) -> list[KVArrival]:
        return self._receiving().poll_arrivals()

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._receiving().set_wakeup(wake)

    # -- shared by both sides -----------------------------------------------------------------------
    def store(self):
        """This thread's store client. None is made after close(): a thread still running then must
        not spend the store's connect timeout reaching a store that may be gone."""
        s = getattr(self._local, "store", None)
        if s is None:
            if self.closed.is_set():
                raise RuntimeError(f"KV transport of {self.worker_id} is closed")
            s = self._local.store = self._new_store()
        return s

    def renew_store(self):
        """Replaces this thread's store client with a new one. HAZARD: a TCPStore client whose reply
        stream got out of step (DistStoreError: a reply of the wrong type) never recovers."""
        self._local.store = None
        return self.store()

    def _beat(self) -> None:
        store, count = self._new_store(), 0
        while not self.closed.is_set():
            count += 1
            try:
                self.beats.publish(store, count)
            except Exception:  # store gone: peers will see us as silent, which is the truth
                pass
            if self.sender is not None:
                try:
                    self.sender.watch_outgoing(store)
                    self.sender.watch_pairs(store)  # broken by the decode side? re-form what broke
                except Exception:  # noqa: BLE001
                    if not self.closed.is_set():  # (closing: the store may be gone first)
                        log.exception("watching KV transfers failed")
            self.closed.wait(self.spec.heartbeat_s)

    def check_alive(self, store, peer: str) -> None:
        """Raises PeerDeadError if the peer is marked dead, closed its transport, or stopped beating."""
        if peer in self.dead_peers:
            raise PeerDeadError(f"peer {peer} is marked dead: {self.dead_peers[peer]}")
        self.check_beating(store, peer)

    def heartbeat_of(self, store, peer: str) -> int:
        return self.beats.count_of(store, peer)  # (heartbeat_records.py: a forgery or replay is no news)

    def check_beating(self, store, peer: str) -> None:
        """Raises PeerDeadError if the peer closed its transport or stopped beating (whatever this
        side decided about the pair)."""
        v, now = self.heartbeat_of(store, peer), time.monotonic()
        if v < 0:
            raise PeerDeadError(f"peer {peer} has shut down its KV transport")
        with self.lock:
            last_v, since = self._liveness.get(peer, (None, now))
            if v != last_v:
                self._liveness[peer] = (v, now)
            elif v > 0 and now - since > self.spec.peer_timeout_s:
                # (v == 0: the peer never started its transport; only deadlines judge it)
                raise PeerDeadError(f"peer {peer} silent for {now - since:.1f}s (no heartbeat within "
                                    f"peer_timeout_s={self.spec.peer_timeout_s}): presumed dead")

    def mark_dead(self, peer: str, why: str, pair_only: bool = False, of: Pair | None = None) -> None:
        """Any thread. Fails every transfer with the peer, each once nothing can write its blocks.

        of: the pair whose payload or deadline found the failure. HAZARD: a pair already given up
        (re-formed, or its peer restarted) fails late on its own thread (gloo: its receives end when
        the old group's sockets close); that must not break the pair that replaced it: ignored.

        pair_only: the pair broke (its payload failed or stalled, a protocol error), not the peer as
        far as we know: the prefill side re-forms it once the peer is seen beating
        (SenderSide.watch_pairs), the decode side tells the prefill through the store (down_key) and
        takes its next Hello. Otherwise the peer is dead (its heartbeat stopped, it shut down, Ray
        said so): nothing is re-formed until a new incarnation shows up."""
        with self.lock:
            if of is not None and self.pairs.get(peer) is not of:
                return  # a stale pair's late failure (see `of`)
            known = peer in self.dead_peers
            if not known:
                self.dead_peers[peer] = why
                pair = self.pairs.get(peer)
                bundles = list(pair.bundles) if pair is not None else []
        if known:
            if not pair_only and self.sender is not None:
                self.sender.forget_broken(peer)  # (a broken pair whose peer then died: not re-formed)
            return
        log.warning("KV transport %s: %s %s is dead: %s", self.worker_id, "the pair with" if pair_only else "peer",
                    peer, why)
        if self.sender is not None:
            if pair_only:
                self.sender.note_broken(peer)
            else:
                self.sender.forget_broken(peer)
        elif pair is not None:
            self._publish_down(peer, pair)
        if pair is not None:
            pair.dead = why
            for b in bundles:  # decided before the abort: a bundle already complete landed intact
                if not b.intact():  # (one coming in needs its first token too)
                    b.failed = f"PeerDeadError: {why}"
            with pair.io:
                try:
                    self._payload_abort(pair)
                except Exception:  # noqa: BLE001
                    log.exception("aborting the KV channel to %s failed", peer)
            for b in bundles:
                if b.completion is not None:
                    b.completion.abandon()
        if self.receiver is not None:
            self._inbox.wake()  # the control thread fails the peer's pending transfers
            self.receiver.wake()

    def _publish_down(self, peer: str, pair: Pair) -> None:
        """Decode side: the prefill learns from the store that this side broke the pair."""
        try:
            self.store().set(down_key(self.ns, peer, self.worker_id, self.incarnation), str(pair.gen))
        except Exception:  # noqa: BLE001 - the store is gone (shutting down); the peer finds out by itself
            log.warning("KV transport %s: could not publish that the pair with %s broke", self.worker_id, peer)

    def peer_died(self, peer: str, why: str) -> None:
        """The caller knows the peer is dead (Ray said so): fail everything with it now."""
        self.mark_dead(peer, why)

    # -- fault injection (chaos and reliability tests) ------------------------------------------------
    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Prefill side: "transfer": the next bundle's pair is killed right after its first launch (the
        payload channel torn down as a failed link would be: the decode side's receives fail at once);
        "stuck_transfer": the next bundle's payload never moves (the pair's channel wedges: nothing
        more goes out on it, both sides find the stall at transfer_timeout_s). Decode side:
        "slow_hello": the next pair formed here waits `seconds` first (a window in which its prefill
        peer can die while the pair forms)."""
        faults = ("transfer", "stuck_transfer") if self.sender is not None else ("slow_hello",)
        if kind not in faults:
            raise ValueError(f"unknown KV transport fault {kind!r} for a {self.role} worker; choose from {faults}")
        with self.lock:
            self.faults.append((kind, seconds))

    def take_fault(self, kind: str, pair: Pair | None = None) -> float | None:
        """The armed fault of this kind (its seconds), now disarmed and recorded as fired on `pair`;
        None if none."""
        with self.lock:
            for i, (k, sec) in enumerate(self.faults):
                if k == kind:
                    del self.faults[i]
                    self.faults_fired += 1
                    self.fired.append({"kind": kind, "peer": pair.peer if pair else None,
                                       "gen": pair.gen if pair else None})
                    return sec
        return None

    def check_incarnation(self, store, peer: str, inc: int) -> None:
        """Connecting: raises PeerDeadError if a later incarnation of `peer` than `inc` has started (the
        one we are forming a pair with is gone; its control entry may not be replaced yet)."""
        now = self.beats.incarnation_of(store, peer)
        if now > inc:
            raise PeerDeadError(f"peer {peer} restarted (incarnation {now}) while we formed a pair with "
                                f"incarnation {inc}")

    def form_interruptibly(self, peer: str, form: Callable[[], None], what: str, inc: int | None = None) -> None:
        """Runs `form()` (a pair's payload rendezvous, which blocks until both ends joined) on a helper
        thread and returns when it did; raises PeerDeadError as soon as the peer is marked dead (the
        router told us), stops beating or (inc) restarts, instead of waiting out the rendezvous' own timeout. An
        abandoned formation ends on its own (it is never used)."""
        done, err = threading.Event(), []

        def run():
            try:
                form()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                err.append(e)
            finally:
                done.set()
        threading.Thread(target=run, name=f"kv-form-{self.worker_id}-{peer}", daemon=True).start()
        store, next_live = self.store(), 0.0
        while not done.wait(0.02):
            if self.closed.is_set():
                raise RuntimeError(f"KV transport of {self.worker_id} closed while {what}")
            if peer in self.dead_peers:
                raise PeerDeadError(f"peer {peer} died while {what}: {self.dead_peers[peer]}")
            if time.monotonic() >= next_live:
                self.check_beating(store, peer)
                if inc is not None:
                    self.check_incarnation(store, peer, inc)
                next_live = time.monotonic() + self.spec.heartbeat_s
        if err:
            raise err[0]

    def forget_incarnation(self, peer: str, why: str) -> None:
        """Control thread or connect(): a new incarnation of `peer` shows up. Everything with the old
        one fails now (its pair's bundles, and on the decode side the transfers it was expected to
        send: their blocks come back), then the peer counts as alive again."""
        with self.lock:
            known = peer in self.pairs or peer in self.dead_peers
        if not known:
            return
        self.mark_dead(peer, f"peer {peer} {why}")
        if self.receiver is not None:
            self.receiver.fail_pending_of(peer)
        with self.lock:
            self.dead_peers.pop(peer, None)
            self._liveness.pop(peer, None)
            old = self.pairs.pop(peer, None)
        if old is not None:
            old.waiter.stop()
            if old.outbox is not None:
                old.outbox.close()
            self._payload_release(old)

    def record(self, side: str, request_id: str, nbytes: int, seconds: float, ok: bool, peer: str) -> TransferStats:
        """One transfer's end on this side, counted in metrics()."""
        st = TransferStats(nbytes, seconds)
        with self.lock:
            self._records.append({"side": side, "peer": peer, "request_id": request_id, "bytes": nbytes,
                                  "seconds": seconds, "GBps": st.gbps, "ok": ok})
            if ok:
                self._totals["transfers"] += 1
                self._totals["bytes"] += nbytes
                self._totals["seconds"] += seconds
            else:
                self._totals["failures"] += 1
        return st

    @property
    def frames_rejected(self) -> int:
        """Decode side: control frames dropped for a missing or bad MAC (cluster/frame_auth.py)."""
        return self._inbox.rejected if self._inbox is not None else 0

    def metrics(self) -> dict:
        """Totals plus the last transfers ({side, peer, request_id, bytes, seconds, GBps, ok})."""
        with self.lock:
            t = dict(self._totals)
            t["GBps"] = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] > 0 else 0.0
            t["dead_peers"] = dict(self.dead_peers)
            t["pairs"] = {p: {"gen": x.gen, "peer_inc": x.peer_inc, "dead": x.dead} for p, x in self.pairs.items()}
            t["faults_fired"] = self.faults_fired
            t["fired"] = list(self.fired)
            t["recent"] = list(self._records)
        t.update(self._payload_metrics())
        return t

    # -- the control thread (decode) ----------------------------------------------------------------
    def _control_loop(self) -> None:
        if self.kv_cache.is_cuda:
            torch.cuda.set_device(self.kv_cache.device)
        receiver, store = self.receiver, self.store()
        next_live = 0.0
        while not self.closed.is_set():
            try:
                msgs = self._inbox.recv(receiver.next_timeout())
            except Exception:  # noqa: BLE001 - the inbox closed under us
                if self.closed.is_set():
                    return
                raise
            for m in msgs:
                try:
                    receiver.handle(m)
                except Exception as e:  # noqa: BLE001 - the pair's state is unknown now
                    log.exception("KV control message %s from %s failed", type(m).__name__, m.p)
                    self.mark_dead(m.p, f"protocol error on {type(m).__name__}: {type(e).__name__}: {e}",
                                   pair_only=True)
            try:
                receiver.take_formed()
                receiver.run_deadlines(store)
                if time.monotonic() >= next_live:
                    receiver.watch_incoming(store)
                    next_live = time.monotonic() + self.spec.heartbeat_s
                receiver.forget_done_keys(store)
            except Exception:  # noqa: BLE001 - the store is gone (shutting down); retry next round
                if self.closed.is_set():
                    return
                log.exception("KV control round failed")
                self.closed.wait(self.spec.heartbeat_s)

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self._inbox is not None:
            self._inbox.wake()
            self._control.join(timeout=5)
        self._heartbeat.join(timeout=5)
        with self.lock:
            pairs = list(self.pairs.values())
        for pair in pairs:
            pair.waiter.stop()
            if pair.outbox is not None:
                pair.outbox.close()
            self._payload_release(pair)
        if self._inbox is not None:
            self._inbox.close()
        try:
            self.beats.publish(self._new_store(), CLOSED)
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
