"""Link: what the two sides of a KV transport share (control.py tells the whole protocol): who this
worker is (id, role, incarnation, KV layout), the store, the pairs and the dead peers under one lock,
the peers' liveness, marking a peer (or a pair) dead, the transfer records and the armed faults.

A side is given the link and the payload (payload.py), and the link is given the payload too: marking
a pair dead aborts its channel, forgetting an old incarnation releases it. The decode side's receiver
listens (`listen`): it is woken when a peer dies, and fails what it still expects from a peer whose
incarnation ended. Nothing here reaches into a side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from cluster.transport.base import TransferStats
from cluster.transport.heartbeat_records import HeartbeatRecords
from cluster.transport.pair import Pair, PeerDeadError, down_key
from cluster.transport.payload import KVPayload
from cluster.transport.plan import KVNumerics, PlanSpec
from cluster.transport.silence_watch import SilenceWatch
from cluster.transport.transport_faults import TransportFaults
from cluster.transport.transport_spec import TransportSpec

log = logging.getLogger(__name__)


class Link:
    """`lock` guards `pairs`, `dead_peers`, `broken`, every pair's bundle list and the sides' own
    tables; `store()` is this thread's store client; `closed` is set once by the transport's close()."""

    def __init__(self, spec: TransportSpec, worker_id: str, role: str, new_store: Callable, beats: HeartbeatRecords,
                 payload: KVPayload, plan_spec: PlanSpec, numerics: KVNumerics | None):
        assert role in ("prefill", "decode"), role
        self.spec, self.worker_id, self.role, self.ns = spec, worker_id, role, spec.namespace
        self.beats = beats
        self.incarnation = beats.incarnation
        self.payload = payload
        self.plan_spec = plan_spec  # this side's own: the peer's tensor-parallel size is 1 until a pair joins both
        self.numerics = numerics
        self.block_size, self.bytes_per_block = plan_spec.block_size, plan_spec.block_bytes
        self.faults = TransportFaults(role)
        self._new_store = new_store  # one client per thread: TCPStore clients are not shared
        self._local = threading.local()
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.pairs: dict[str, Pair] = {}
        self.dead_peers: dict[str, str] = {}
        # Prefill: pairs that broke while their peer lived on, peer -> its heartbeat count when the pair
        # broke; SenderSide.watch_pairs re-forms them once the peer is seen beating after that.
        self.broken: dict[str, int] = {}
        self._silence = SilenceWatch(spec.peer_timeout_s)  # the peers' heartbeat counts, under `lock`
        self._records: deque[dict] = deque(maxlen=1024)
        self._totals = {"transfers": 0, "bytes": 0, "seconds": 0.0, "failures": 0}
        self._on_down: Callable[[], None] | None = None
        self._on_forgotten: Callable[[str], None] | None = None

    def listen(self, on_down: Callable[[], None], on_forgotten: Callable[[str], None]) -> None:
        """Decode side: on_down() after a peer or pair is marked dead (the control thread then fails its
        pending transfers, the decode loop polls); on_forgotten(peer) when a new incarnation of `peer`
        shows up, before it counts as alive again (what the old one was to send fails now)."""
        self._on_down, self._on_forgotten = on_down, on_forgotten

    # -- the store ------------------------------------------------------------------------------------
    def new_store(self):
        """A store client of its own (a thread that keeps it)."""
        return self._new_store()

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

    # -- liveness -------------------------------------------------------------------------------------
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
            quiet = self._silence.silent(peer, v, now) if v > 0 else None  # (silence_watch.py: only watched silence)
        if quiet is not None:  # (v == 0: the peer never started its transport; only deadlines judge it)
            raise PeerDeadError(f"peer {peer} silent for {quiet:.1f}s (no heartbeat within "
                                f"peer_timeout_s={self.spec.peer_timeout_s}): presumed dead")

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
        router told us), stops beating or (inc) restarts, instead of waiting out the rendezvous' own
        timeout. An abandoned formation ends on its own (it is never used)."""
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

    # -- peers and pairs that die ---------------------------------------------------------------------
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
            if not pair_only and self.role == "prefill":
                self.forget_broken(peer)  # (a broken pair whose peer then died: not re-formed)
            return
        log.warning("KV transport %s: %s %s is dead: %s", self.worker_id, "the pair with" if pair_only else "peer",
                    peer, why)
        if self.role == "prefill":
            if pair_only:
                self._note_broken(peer)
            else:
                self.forget_broken(peer)
        elif pair is not None:
            self._publish_down(peer, pair)
        if pair is not None:
            pair.dead = why
            for b in bundles:  # decided before the abort: a bundle already complete landed intact
                if not b.intact():  # (one coming in needs its first token too)
                    b.failed = f"PeerDeadError: {why}"
            with pair.io:
                try:
                    self.payload.abort(pair)
                except Exception:  # noqa: BLE001
                    log.exception("aborting the KV channel to %s failed", peer)
            for b in bundles:
                if b.completion is not None:
                    b.completion.abandon()
        if self._on_down is not None:
            self._on_down()

    def _note_broken(self, peer: str) -> None:
        """Prefill, mark_dead(pair_only): re-formed once the peer is seen beating after now."""
        try:
            hb = self.heartbeat_of(self.store(), peer)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to re-form with
            return
        with self.lock:
            self.broken[peer] = hb

    def forget_broken(self, peer: str) -> None:
        with self.lock:
            self.broken.pop(peer, None)

    def _publish_down(self, peer: str, pair: Pair) -> None:
        """Decode side: the prefill learns from the store that this side broke the pair."""
        try:
            self.store().set(down_key(self.ns, peer, pair.peer_inc, self.worker_id, self.incarnation), str(pair.gen))
        except Exception:  # noqa: BLE001 - the store is gone (shutting down); the peer finds out by itself
            log.warning("KV transport %s: could not publish that the pair with %s broke", self.worker_id, peer)

    def forget_incarnation(self, peer: str, why: str) -> None:
        """Control thread or connect(): a new incarnation of `peer` shows up. Everything with the old
        one fails now (its pair's bundles, and on the decode side the transfers it was expected to
        send: their blocks come back), then the peer counts as alive again."""
        with self.lock:
            known = peer in self.pairs or peer in self.dead_peers
        if not known:
            return
        self.mark_dead(peer, f"peer {peer} {why}")
        if self._on_forgotten is not None:
            self._on_forgotten(peer)
        with self.lock:
            self.dead_peers.pop(peer, None)
            self._silence.forget(peer)
            old = self.pairs.pop(peer, None)
        if old is not None:
            self.drop(old)

    def drop(self, pair: Pair) -> None:
        """A pair given up for good (its peer restarted, or this transport closed): its threads stop,
        its payload gives back what it holds."""
        pair.waiter.stop()
        if pair.outbox is not None:
            pair.outbox.close()
        self.payload.release(pair)

    # -- records --------------------------------------------------------------------------------------
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

    def metrics(self) -> dict:
        """Totals plus the last transfers ({side, peer, request_id, bytes, seconds, GBps, ok}), the
        dead peers, the pairs and the faults that fired."""
        with self.lock:
            t = dict(self._totals)
            t["GBps"] = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] > 0 else 0.0
            t["dead_peers"] = dict(self.dead_peers)
            t["pairs"] = {p: {"gen": x.gen, "peer_inc": x.peer_inc, "dead": x.dead} for p, x in self.pairs.items()}
            t["recent"] = list(self._records)
        t.update(self.faults.metrics())
        return t
