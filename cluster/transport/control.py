"""The control plane every KV transport shares; how the bytes move is the payload's, an object the
transport is given (payload.py; torch_dist.py: NCCL/gloo point-to-point, same_gpu.py: CUDA IPC copies,
tp_payload.py: a tensor-parallel worker's ranks).

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

Threads: (both) a heartbeat thread that only beats; (prefill) a watch thread for the peers of transfers
in flight and the pairs to re-form; one waiter per pair; (decode) the control thread, which owns the inbox, posts receives and runs
deadlines, cancels and liveness checks.

The code, one object per concern, each given what it uses (like vLLM's KV connectors, one object per
role): `ControlledTransport` (here) builds them and runs the threads; the `Link` (link.py) is what
both roles share: identity, the store, the pairs and dead peers under one lock, liveness, marking a
peer dead, the records, the armed faults; the payload (payload.py: TorchDistPayload, SameGPUPayload or
TPPayload, chosen by factory.py and named in `repr()` and metrics()) moves the bytes. A prefill
transport holds a `SenderSide` (sender_side.py), a decode transport a `ReceiverSide`
(receiver_side.py) that its control thread runs; each side is given the link and the payload, and a
call of the other role raises.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import msgspec
import torch

from cluster.wire.messages import Reservation
from cluster.transport.base import KVArrival, KVSend, KVTransport, Shipment
from cluster.transport.channel import Inbox
from cluster.transport.heartbeat_records import CLOSED, HeartbeatRecords
from cluster.transport.link import Link
from cluster.transport.payload import KVPayload, PayloadEnd
from cluster.transport.plan import KVNumerics, PlanSpec
from cluster.transport.receiver_side import ReceiverSide
from cluster.transport.rendezvous_store import local_address_towards
from cluster.transport.sender_side import SenderSide
from cluster.wire.socket_bounds import RateLimitedLog

log = logging.getLogger(__name__)
_beat_failures = RateLimitedLog(log, interval_s=30.0)
# A store gone for good fails every round of the watch thread: one traceback per 30 s, not one per beat.
_watch_failures = RateLimitedLog(log, interval_s=30.0)

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


class ControlledTransport(KVTransport):
    """A worker's KV transport: the link, the payload, and the side of its role, built here and
    driven by this transport's threads (heartbeat; decode: the control thread)."""

    def __init__(self, spec, kv_cache: torch.Tensor, worker_id: str, role: str, store_factory,
                 payload: Callable[[PayloadEnd], KVPayload], kv_heads: int | None = None, tp_size: int = 1,
                 numerics: KVNumerics | None = None):
        """payload: builds this transport's payload once its incarnation is known (factory.py).
        tp_size, kv_heads: this worker's tensor-parallel group and the model's KV heads when this
        transport is its rank 0 (tp_payload.py); by default one process holds every head (kv_cache's).
        numerics: what the cache's K/V is (plan.KVNumerics); a pair whose two sides differ is refused."""
        assert role in ("prefill", "decode"), role
        self.role, self.worker_id = role, worker_id
        ns = spec.namespace
        store = store_factory()
        beats = HeartbeatRecords(ns, worker_id)
        beats.allocate(store)  # a new life (a clean close left it negative)
        self.payload = payload(PayloadEnd(spec, kv_cache, worker_id, role, beats.incarnation, store_factory))
        name, chunk_bytes = self.payload.plan_kind()
        c = kv_cache
        plan_spec = PlanSpec(name, c.shape[0], c.shape[3], kv_heads or c.shape[4], c.shape[5],
                             str(c.dtype).removeprefix("torch."), c.element_size(), chunk_bytes,
                             prefill_tp=tp_size if role == "prefill" else 1,
                             decode_tp=tp_size if role == "decode" else 1)
        self.link = Link(spec, worker_id, role, store_factory, beats, self.payload, plan_spec, numerics)
        self.sender: SenderSide | None = None
        self.receiver: ReceiverSide | None = None
        self._inbox: Inbox | None = None
        self._control: threading.Thread | None = None
        if role == "decode":
            host = None
            if spec.store_host:
                host = spec.bind_host or local_address_towards(spec.store_host, spec.store_port)
            self._inbox = Inbox(host, f"{ns}/{worker_id}", spec.secret, receiver=f"{worker_id}.{self.incarnation}")
            self.receiver = ReceiverSide(self.link, self.payload, self._inbox)
            info = {"endpoint": self._inbox.endpoint, "layout": plan_spec.to_wire(), "pid": os.getpid(),
                    "incarnation": self.incarnation, "numerics": numerics.as_dict() if numerics else None,
                    **self.payload.info()}
            beats.keep(store, f"{ns}/ctl/{worker_id}", msgspec.msgpack.encode(info))
            self._control = threading.Thread(target=self.receiver.run, name=f"kv-control-{worker_id}", daemon=True)
            self._control.start()
        else:
            self.sender = SenderSide(self.link, self.payload)
        self._heartbeat = threading.Thread(target=self._beat, name=f"kv-heartbeat-{worker_id}", daemon=True)
        self._heartbeat.start()
        self._watch: threading.Thread | None = None
        if self.sender is not None:
            self._watch = threading.Thread(target=self._watch_sends, name=f"kv-watch-{worker_id}", daemon=True)
            self._watch.start()
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"ControlledTransport({self.worker_id!r}, {self.role}, payload={type(self.payload).__name__})"

    # -- what the tests and the worker read -----------------------------------------------------------
    @property
    def incarnation(self) -> int:
        return self.link.incarnation

    @property
    def pairs(self):
        return self.link.pairs

    @property
    def numerics(self) -> KVNumerics | None:
        return self.link.numerics

    @property
    def bytes_per_block(self) -> int:
        return self.link.bytes_per_block

    @property
    def kv_cache(self) -> torch.Tensor:
        """The tensor moved (an FP8 cache's uint8 view)."""
        return self.payload.kv_cache

    @property
    def frames_rejected(self) -> int:
        """Decode side: control frames dropped for a missing or bad MAC (cluster/wire/frame_auth.py)."""
        return self._inbox.rejected if self._inbox is not None else 0

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

    def shipment_for_followers(self, shipment) -> bytes:
        """Prefill, tensor parallelism: what the follower ranks ship with the pass that computes this
        shipment's KV (the payload's followers_part; b"" without followers)."""
        return self.payload.followers_part(shipment)

    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        self._receiving().expect(reservation, prefill_worker_id)

    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        self._receiving().cancel(reservation, prefill_worker_id)

    def poll_arrivals(self) -> list[KVArrival]:
        return self._receiving().poll_arrivals()

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._receiving().set_wakeup(wake)

    def peer_died(self, peer: str, why: str) -> None:
        """The caller knows the peer is dead (Ray said so): fail everything with it now."""
        self.link.mark_dead(peer, why)

    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Arms one fault (transport_faults.py lists them per role; chaos and reliability tests)."""
        self.link.faults.arm(kind, seconds)

    def metrics(self) -> dict:
        """The link's totals and recent transfers, plus the payload's entries (its name among them)."""
        m = self.link.metrics()
        m["payload"] = type(self.payload).__name__
        m.update(self.payload.metrics())
        return m

    # -- the heartbeat and watch threads -------------------------------------------------------------
    def _beat(self) -> None:
        # HAZARD: nothing but the beat on this thread. Re-forming a pair (watch_pairs) blocks in its
        # rendezvous for up to transfer_timeout_s; on this thread it stopped the beats, and the peer
        # took this worker for dead after peer_timeout_s (seen: "silent for 16.9s" mid re-formation).
        link = self.link
        store, count = link.new_store(), 0
        while not link.closed.is_set():
            count += 1
            try:
                link.beats.publish(store, count)
            except Exception as e:  # noqa: BLE001 - store gone: peers will see us as silent, which is the truth
                if not link.closed.is_set():  # said: a prefill re-forms a pair it broke only once we beat
                    _beat_failures.warn("KV transport %s: a heartbeat failed: %s: %s", link.worker_id,
                                        type(e).__name__, e)
            link.closed.wait(link.spec.heartbeat_s)

    def _watch_sends(self) -> None:
        """The sender's watchers, every heartbeat_s: outgoing transfers past their deadlines, and pairs
        the decode side broke (re-formed here)."""
        link = self.link
        store = link.new_store()
        while not link.closed.wait(link.spec.heartbeat_s):
            try:
                self.sender.watch_outgoing(store)
                self.sender.watch_pairs(store)  # broken by the decode side? re-form what broke
            except Exception:  # noqa: BLE001
                if not link.closed.is_set():  # (closing: the store may be gone first)
                    _watch_failures.warn("KV transport %s: watching KV transfers failed", link.worker_id,
                                         exc_info=True)

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        link = self.link
        if link.closed.is_set():
            return
        link.closed.set()
        if self._inbox is not None:
            self._inbox.wake()
            self._control.join(timeout=5)
        self._heartbeat.join(timeout=5)
        if self._watch is not None:
            self._watch.join(timeout=5)
        with link.lock:
            pairs = list(link.pairs.values())
        for pair in pairs:
            link.drop(pair)
        if self._inbox is not None:
            self._inbox.close()
        try:
            link.beats.publish(link.new_store(), CLOSED)
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
