"""The decode side of a ControlledTransport (control.py tells the whole protocol): expected transfers
and their deadlines, cancels, this end of a pair formed on a Hello, Begin/Commit/Abort from the push
channel, arrivals.

Messages are handled on the transport's control thread, in the order the prefill peer sent them; the
decode loop only calls expect, cancel and poll_arrivals, and none of them blocks. Ownership: an
expected transfer's blocks stay reserved until its arrival, landed or failed. A passed deadline or a
cancel tries compare_set("", CANCEL) on the claim key (pair.py); if the prefill claimed first, its
Begin (or Abort) is on the way and the transfer gets transfer_timeout_s more instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from cluster.kv.kv_blocks import blocks_for_tokens
from cluster.wire.messages import KVHeader, Reservation
from cluster.wire.socket_bounds import RateLimitedLog
from cluster.transport.base import KVArrival, KVReceiver, TransferStats
from cluster.transport.channel import Abort, Begin, Broken, Commit, Hello, Inbox, Message
from cluster.transport.in_bundle import Expected, InBundle
from cluster.transport.link import Link
from cluster.transport.pair import CANCEL, Pair, PeerDeadError, claim_key, verdict_key
from cluster.transport.payload import KVPayload
from cluster.transport.plan import PlanSpec, fingerprint

log = logging.getLogger(__name__)
# A store gone for good fails every control round: one traceback per 30 s, not one per beat.
_round_failures = RateLimitedLog(log, interval_s=30.0)


class ReceiverSide(KVReceiver):
    """Owns what only a decode worker has: the expected transfers, the bundles in flight, the arrivals,
    the decode loop's wake-up and the control thread's rounds (`run`). What both sides share is the
    link's (link.py); the bytes move through the payload (payload.py) it is given."""

    def __init__(self, link: Link, payload: KVPayload, inbox: Inbox):
        self.link, self.payload = link, payload
        self._inbox = inbox  # wake() hands the control thread work (its deadlines) at once
        self._pending: dict[tuple[str, int], Expected] = {}
        self._arrivals: deque[KVArrival] = deque()
        self._in_flight: list[InBundle] = []
        self._done_keys: deque[str] = deque()  # claim keys to delete (the control thread does)
        self._wakeup: Callable[[], None] | None = None
        # Pairs forming on a helper thread (control thread only): peer -> (pair, thread, errors,
        # the peer's messages that came meanwhile, handled once the pair is in place).
        self._forming: dict[str, tuple[Pair, threading.Thread, list, list]] = {}
        link.listen(on_down=self._peer_down, on_forgotten=self.fail_pending_of)

    def _key(self, peer: str, seq: int) -> str:
        return claim_key(self.link.ns, peer, self.link.worker_id, self.link.incarnation, seq)

    def _peer_down(self) -> None:
        """A peer or pair was marked dead: the control thread fails its pending transfers now, and the
        decode loop polls the failed arrivals."""
        self._inbox.wake()
        self.wake()

    # -- the decode loop's side -------------------------------------------------------------------------
    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._wakeup = wake

    def wake(self) -> None:
        """Any thread: poll_arrivals() may have something new."""
        w = self._wakeup
        if w is not None:
            w()

    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        link = self.link
        key = (prefill_worker_id, reservation.transfer_seq)
        with link.lock:
            if key in self._pending:
                raise ValueError(f"transfer {reservation.transfer_seq} from {prefill_worker_id} is already expected")
            self._pending[key] = Expected(reservation, prefill_worker_id, time.monotonic() + link.spec.expect_timeout_s)
            dead = prefill_worker_id in link.dead_peers
        if dead:
            self._inbox.wake()  # fails it right away

    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        with self.link.lock:
            e = self._pending.get((prefill_worker_id, reservation.transfer_seq))
            if e is None or e.reservation != reservation or e.state != "waiting":
                return  # claimed, in flight or arrived already (it lands or fails), or never expected
            e.cancel = True
        self._inbox.wake()

    def poll_arrivals(self) -> list[KVArrival]:
        out: list[KVArrival] = []
        with self.link.lock:
            while self._arrivals:
                out.append(self._arrivals.popleft())
            done = [b for b in self._in_flight if (b.committed or b.failed) and b.completion.done()]
            for b in done:
                self._in_flight.remove(b)
                b.pair.bundles.remove(b)
        for b in done:
            out += self._bundle_arrivals(b)
        return out

    def _bundle_arrivals(self, b: InBundle) -> list[KVArrival]:
        link = self.link
        seconds = time.monotonic() - b.t_begin
        err = b.failed or b.completion.error()
        out = []
        for k, e in enumerate(b.expects):
            res = e.reservation
            self._done_keys.append(self._key(b.pair.peer, res.transfer_seq))
            n = len(b.items[k].src)
            header = None
            if b.committed:
                header = KVHeader(res.request_id, res.transfer_seq, b.num_tokens[k], b.tokens[k], ok=b.oks[k],
                                  logprobs=b.logprobs[k] if b.logprobs else None)
            why = err or (None if header.ok else "prefill aborted or failed")
            if why is None:
                out.append(KVArrival(res, header, link.record("recv", res.request_id, n * link.bytes_per_block, seconds,
                                                           True, b.pair.peer)))
            else:
                link.record("recv", res.request_id, 0, seconds, False, b.pair.peer)
                out.append(KVArrival(res, header if err is None else None, TransferStats(0, seconds), error=why))
        return out

    def _arrive(self, arrival: KVArrival) -> None:
        with self.link.lock:
            self._arrivals.append(arrival)
        self.wake()

    # -- the control thread's side ----------------------------------------------------------------------
    def run(self) -> None:
        """The control thread: the inbox's messages in order, then formed pairs, deadlines, liveness
        and done claim keys, until the link closes."""
        link, store = self.link, self.link.store()
        if self.payload.kv_cache.is_cuda:
            torch.cuda.set_device(self.payload.kv_cache.device)
        next_live = 0.0
        while not link.closed.is_set():
            try:
                msgs = self._inbox.recv(self.next_timeout())
            except Exception:  # noqa: BLE001 - the inbox closed under us
                if link.closed.is_set():
                    return
                raise
            for m in msgs:
                try:
                    self.handle(m)
                except Exception as e:  # noqa: BLE001 - the pair's state is unknown now
                    log.exception("KV control message %s from %s failed", type(m).__name__, m.p)
                    link.mark_dead(m.p, f"protocol error on {type(m).__name__}: {type(e).__name__}: {e}",
                                   pair_only=True)
            try:
                self.take_formed()
                self.run_deadlines(store)
                if time.monotonic() >= next_live:
                    self.watch_incoming(store)
                    next_live = time.monotonic() + link.spec.heartbeat_s
                self.forget_done_keys(store)
            except Exception:  # noqa: BLE001 - the store is gone (shutting down); retry next round
                if link.closed.is_set():
                    return
                _round_failures.warn("KV transport %s: a KV control round failed", link.worker_id, exc_info=True)
                link.closed.wait(link.spec.heartbeat_s)

    # -- the control thread's side: one round ---------------------------------------------------------
    def next_timeout(self) -> float:
        """How long the control thread may wait for a message: until the soonest expect deadline
        (briefly while a pair forms: it is taken in once its helper thread is done)."""
        heartbeat_s = 0.02 if self._forming else self.link.spec.heartbeat_s
        now = time.monotonic()
        with self.link.lock:
            soonest = min((e.deadline for e in self._pending.values()), default=now + heartbeat_s)
        return max(0.0, min(heartbeat_s, soonest - now))

    def handle(self, m: Message) -> None:
        link, peer = self.link, m.p
        if isinstance(m, Hello):
            self._on_hello(m)
            return
        forming = self._forming.get(peer)
        if forming is not None:
            forming[3].append(m)  # in order, once the pair is formed
            return
        with link.lock:
            pair = link.pairs.get(peer)
        if pair is None:
            raise RuntimeError(f"{type(m).__name__} from {peer} before its hello")
        if isinstance(m, Broken):
            if m.gen == pair.gen and pair.dead is None:
                link.mark_dead(peer, f"the prefill broke the pair: {m.why}", pair_only=True)
            return
        if pair.dead is not None:
            return  # everything of a dead peer has failed already; its late messages change nothing
        if isinstance(m, Begin):
            self._on_begin(pair, m)
        elif isinstance(m, Commit):
            self._on_commit(pair, m)
        else:
            self._on_abort(pair, m)

    def _on_hello(self, m: Hello) -> None:
        """Answers a prefill's hello (the verdict key: "ok", or why not), then forms this side's half
        of the pair while the prefill forms its own: a new incarnation of the prefill, or a new
        generation of a pair that broke. The forming is on a helper thread: a prefill that dies while
        the pair forms holds up neither this thread nor its other pairs (take_formed)."""
        link, peer = self.link, m.p
        store = link.store()
        key = verdict_key(link.ns, peer, m.inc, link.worker_id, link.incarnation, m.gen)
        pair = Pair(peer, link.worker_id)
        pair.peer_inc, pair.gen = m.inc, m.gen
        try:
            theirs = PlanSpec.from_wire(m.layout, peer)  # the pair's, as the prefill joined it
            pair.spec = link.plan_spec.joined(theirs, "decode")
            pair.spec.check_peer(theirs, peer)
            link.forget_incarnation(peer, f"it said hello again (incarnation {m.inc}, pair generation {m.gen})")
            earlier = self._forming.pop(peer, None)  # an earlier formation that never finished is given up
            if earlier is not None:
                self.payload.release(earlier[0])
            self.payload.admit(pair, m)
        except Exception as e:
            store.set(key, f"{type(e).__name__}: {e}".encode())
            raise
        store.set(key, b"ok")
        errors: list = []
        delay = link.faults.take("slow_hello", pair)

        def form():
            try:
                if delay:
                    time.sleep(delay)  # fault "slow_hello": a window in which the prefill can die
                with pair.io:
                    self.payload.accept(pair, m)
            except BaseException as e:  # noqa: BLE001 - the control thread reports it
                errors.append(e)
            finally:
                self._inbox.wake()
        th = threading.Thread(target=form, name=f"kv-accept-{link.worker_id}-{peer}", daemon=True)
        self._forming[peer] = (pair, th, errors, [])
        th.start()

    def take_formed(self) -> None:
        """Control thread: pairs whose helper finished are taken in (the messages their prefill sent
        meanwhile handled now, in order); a formation that failed, or whose prefill died meanwhile,
        leaves the peer dead (its pending transfers fail) and gives its staging back."""
        link = self.link
        for peer, (pair, th, errors, queued) in list(self._forming.items()):
            dead = link.dead_peers.get(peer)
            if th.is_alive() and dead is None:
                try:
                    link.check_beating(link.store(), peer)
                    continue
                except PeerDeadError as e:
                    dead = str(e)
            del self._forming[peer]
            if dead is not None or errors:
                why = dead or f"forming the pair failed: {type(errors[0]).__name__}: {errors[0]}"
                log.warning("KV transport %s: the pair with %s did not form: %s", link.worker_id, peer, why)
                self.payload.release(pair)  # (a helper still forming it ends on its own; the pair is never used)
                with link.lock:
                    link.dead_peers.setdefault(peer, why)
                continue
            pair.waiter.start()
            with link.lock:
                link.pairs[peer] = pair
            for m in queued:
                try:
                    self.handle(m)
                except Exception as e:  # noqa: BLE001 - as the control loop does
                    log.exception("KV control message %s from %s failed", type(m).__name__, peer)
                    link.mark_dead(peer, f"protocol error on {type(m).__name__}: {type(e).__name__}: {e}",
                                pair_only=True)
                    break

    def _on_begin(self, pair: Pair, m: Begin) -> None:
        link, peer, entries = self.link, pair.peer, m.items
        srcs = [tuple(np.frombuffer(src, dtype="<i4").tolist()) for _, _, _, src in entries]
        with link.lock:
            expects = [self._pending.get((peer, seq)) for seq, *_ in entries]
        for e, (seq, rid, ntok, _), src in zip(expects, entries, srcs):
            if e is None or e.reservation.request_id != rid:
                raise RuntimeError(f"begin of transfer {seq} ({rid}) that is not expected from {peer}")
            if not 0 < len(src) <= len(e.reservation.block_ids) or blocks_for_tokens(ntok, link.block_size) != len(src):
                raise RuntimeError(f"transfer {seq}: {len(src)} blocks for {ntok} tokens into {len(e.reservation.block_ids)}")
        items, launches = self.payload.plan(pair, srcs, [tuple(e.reservation.block_ids[:len(s)]) for e, s in zip(expects, srcs)],
                                  m.layerwise)
        if fingerprint(items, launches) != m.fingerprint:
            raise RuntimeError("the bundle's plan differs between prefill and decode (mismatched code?)")
        b = InBundle(m.b, pair, expects, [x[2] for x in entries], items, launches, time.monotonic())
        with link.lock:
            for e in expects:
                del self._pending[(peer, e.reservation.transfer_seq)]
            pair.bundles.append(b)
            self._in_flight.append(b)
        with pair.io:
            b.completion, err = self.payload.post(pair, b)
        if err is not None:
            b.failed = f"posting receives failed: {err}"
            link.mark_dead(peer, b.failed, pair_only=True, of=pair)
        pair.waiter.put(b.completion, lambda: self._landed(b))

    def _landed(self, b: InBundle) -> None:
        """Waiter thread: the bundle's payload is done; a failed one means the pair is broken."""
        err = b.completion.error()
        if err is not None:
            self.link.mark_dead(b.pair.peer, f"a KV payload failed: {err}", pair_only=True, of=b.pair)
        self.wake()

    def _on_commit(self, pair: Pair, m: Commit) -> None:
        with self.link.lock:
            b = next((x for x in pair.bundles if x.id == m.b), None)
        if (b is None or len(m.tokens) != len(b.expects) or len(m.ok) != len(b.expects)
                or len(m.logprobs) not in (0, len(b.expects))):
            raise RuntimeError(f"commit of bundle {m.b} that is not in flight (or not of its size)")
        self.payload.commit(pair, b, m)
        with self.link.lock:
            b.tokens, b.oks, b.logprobs, b.committed = list(m.tokens), list(m.ok), list(m.logprobs), True
        self.wake()

    def _on_abort(self, pair: Pair, m: Abort) -> None:
        with self.link.lock:
            e = self._pending.pop((pair.peer, m.seq), None)
        if e is None or e.reservation.request_id != m.request_id:
            raise RuntimeError(f"abort of transfer {m.seq} ({m.request_id}) that is not expected")
        res = e.reservation
        self._done_keys.append(self._key(pair.peer, res.transfer_seq))
        self.link.record("recv", res.request_id, 0, 0.0, True, pair.peer)
        self._arrive(KVArrival(res, KVHeader(res.request_id, res.transfer_seq, 0, -1, ok=False), TransferStats(0, 0.0),
                               error="prefill aborted or failed"))

    def run_deadlines(self, store) -> None:
        """Control thread: expect deadlines, cancels, and the pending transfers of dead peers."""
        link, spec = self.link, self.link.spec
        now = time.monotonic()
        with link.lock:
            due = [e for e in self._pending.values()
                   if e.peer in link.dead_peers or e.deadline <= now or (e.cancel and e.state == "waiting")]
            stalled = [b for b in self._in_flight if not b.failed and now - b.t_begin > spec.transfer_timeout_s
                       and (not b.committed or not b.completion.done())]
        for e in due:
            res, dead = e.reservation, link.dead_peers.get(e.peer)
            if e.state == "claimed" and dead is None:
                link.mark_dead(e.peer, f"transfer {res.transfer_seq} was claimed but no KV came within "
                                    f"transfer_timeout_s={spec.transfer_timeout_s}", pair_only=True)
                dead = link.dead_peers[e.peer]
            key = self._key(e.peer, res.transfer_seq)
            v = store.compare_set(key, "", CANCEL)
            if v != CANCEL and dead is None:
                with link.lock:  # claimed meanwhile: its begin (or abort) is on the way
                    e.state, e.deadline, e.cancel = "claimed", now + spec.transfer_timeout_s, False
                continue
            with link.lock:
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
                why = f"TimeoutError: no KV from {e.peer} within expect_timeout_s={spec.expect_timeout_s}"
            link.record("recv", res.request_id, 0, 0.0, False, e.peer)
            self._arrive(KVArrival(res, None, TransferStats(0, 0.0), error=why))
        for b in stalled:
            link.mark_dead(b.pair.peer, f"a KV bundle was not {'done' if b.committed else 'committed'} within "
                                     f"transfer_timeout_s={spec.transfer_timeout_s}", pair_only=True, of=b.pair)

    def watch_incoming(self, store) -> None:
        """Control thread, every heartbeat_s: a peer we expect KV from must stay alive."""
        link = self.link
        with link.lock:
            peers = {e.peer for e in self._pending.values()} | {b.pair.peer for b in self._in_flight}
            peers -= set(link.dead_peers)
        for peer in sorted(peers):
            try:
                link.check_alive(store, peer)
            except PeerDeadError as e:
                link.mark_dead(peer, str(e))

    def forget_done_keys(self, store) -> None:
        """Control thread: the claim keys of transfers that arrived (or can no longer land) go."""
        while self._done_keys:
            store.delete_key(self._done_keys.popleft())

    def fail_pending_of(self, peer: str) -> None:
        """The transfers still expected from a dead incarnation of `peer` fail now."""
        link = self.link
        store = link.store()
        with link.lock:
            due = [e for e in self._pending.values() if e.peer == peer]
        why = link.dead_peers.get(peer, "its incarnation ended")
        for e in due:
            res = e.reservation
            key = self._key(e.peer, res.transfer_seq)
            v = store.compare_set(key, "", CANCEL)
            with link.lock:
                if self._pending.pop((e.peer, res.transfer_seq), None) is not e:
                    continue
            if v != CANCEL:  # claimed by the dead incarnation: no receive was posted, nothing can land
                self._done_keys.append(key)
            link.record("recv", res.request_id, 0, 0.0, False, e.peer)
            self._arrive(KVArrival(res, None, TransferStats(0, 0.0), error=f"PeerDeadError: {why}"))
