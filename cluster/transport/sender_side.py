"""The prefill side of a KV transport (control.py tells the whole protocol): pairs formed from
this end, claims, bundles, layer-wise launches, seal and commit, the watch over transfers in flight,
aborts.

A claim (compare_set("", CLAIM) on the transfer's claim key, pair.py) comes before any byte can reach
the reserved blocks; a CANCEL found there means the decode side gave up first: the transfer fails with
TimeoutError and its blocks are back in the decode pool. A bundle (what one shipment sends one decode
peer) holds its pair's `order` lock from its begin until its last launch is issued, so a pair's
launches go out in the order of their Begins, which is the order the decode side posts its receives.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import msgspec
import numpy as np
import torch.distributed as dist

from cluster.sampling.logprobs import PrefillLogprobs
from cluster.wire.messages import Reservation
from cluster.kv.kv_blocks import blocks_for_tokens
from cluster.transport.base import KVSend, KVSender, Shipment
from cluster.transport.channel import Abort, Begin, Broken, Commit, Hello, Outbox
from cluster.transport.completion import ReadyCompletion, WedgedCompletion
from cluster.transport.link import Link
from cluster.transport.out_bundle import OutBundle
from cluster.transport.pair import ABORT, CANCEL, CLAIM, Pair, PeerDeadError, claim_key, down_key, verdict_key
from cluster.transport.payload import KVPayload
from cluster.transport.plan import KVNumerics, PlanSpec, check_pair_numerics, fingerprint
from cluster.worker.startup_heap import collect_including_frozen

log = logging.getLogger(__name__)


class _Shipment(Shipment):
    def __init__(self, sender: SenderSide):
        self.s = sender
        self.futures: dict[str, Future] = {}
        self.bundles: list[OutBundle] = []
        self._kv_done = self._committed = False

    def layer_done(self, layer: int) -> None:
        if self._kv_done or not any(b.issued < len(b.launches) and b.launches[b.issued].last_layer <= layer
                                    for b in self.bundles):
            return  # no launch waits for this layer (not layer-wise, or already issued)
        ready = self.s.payload.mark()
        for b in self.bundles:
            self.s._issue_through(b, layer, ready)

    def kv_done(self) -> None:
        if self._kv_done:
            return
        self._kv_done = True
        ready = self.s.payload.mark() if self.bundles else None
        for b in self.bundles:
            self.s._issue_through(b, None, ready)
            self.s._seal(b)

    def commit(self, first_tokens: Mapping[str, int | None],
               logprobs: Mapping[str, PrefillLogprobs] | None = None) -> None:
        if self._committed:
            raise RuntimeError("shipment committed twice")
        self.kv_done()
        self._committed = True
        for b in self.bundles:
            self.s._commit(b, first_tokens, logprobs or {})


class SenderSide(KVSender):
    """Owns what only a prefill worker has: its pair locks, bundle ids and pair generations. What both
    sides share (the pairs, the dead peers, the lock, the store, liveness, records) is the link's
    (link.py); the bytes move through the payload (payload.py) it is given."""

    def __init__(self, link: Link, payload: KVPayload):
        self.link, self.payload = link, payload
        self._pair_locks: dict[str, threading.Lock] = {}
        self._bundle_ids = itertools.count()
        self._gens: dict[str, tuple[int, int]] = {}  # decode peer -> (its incarnation, the last pair generation)
        # (peer, its heartbeat count at a break) -> when the watch first waited for its next beat (None: said)
        self._unformed_since: dict[tuple[str, int], float | None] = {}

    # -- pairs ----------------------------------------------------------------------------------------
    def connect(self, decode_worker_ids: Sequence[str]) -> dict[str, float]:
        link, out = self.link, {}
        store = link.store()
        for peer in sorted(set(decode_worker_ids)):  # the same order everywhere: see _pair
            t0 = time.perf_counter()
            raw = store.get(f"{link.ns}/ctl/{peer}") if store.check([f"{link.ns}/ctl/{peer}"]) else None
            inc = msgspec.msgpack.decode(raw).get("incarnation", 0) if raw is not None else None
            with link.lock:
                pair = link.pairs.get(peer)
                # A dead peer that has not published a new incarnation stays dead (_pair raises).
                stale = inc is not None and (pair.peer_inc != inc if pair is not None else peer in link.dead_peers)
            if stale:  # the decode worker restarted: form the pair with its new incarnation
                link.forget_incarnation(peer, f"published incarnation {inc}")
            self._pair(peer)
            out[peer] = time.perf_counter() - t0
        return out

    def _pair(self, peer: str) -> Pair:
        """The pair with this decode worker, formed and warmed on first use.

        The decode side forms its half on our hello, from its control thread, one hello at a time; a
        prefill forms one pair at a time. So a decode worker only ever waits for a prefill worker that
        is forming a pair with it: no cycle, whatever the order of hellos."""
        link = self.link
        with link.lock:
            pair = link.pairs.get(peer)
            lock = self._pair_locks.setdefault(peer, threading.Lock())
        if pair is None:
            with lock:
                with link.lock:
                    pair = link.pairs.get(peer)
                if pair is None:
                    pair = self._open_pair(peer)
        if pair.dead is not None:
            raise PeerDeadError(f"peer {peer} is marked dead: {pair.dead}")
        if pair.wedged:
            raise PeerDeadError(f"the KV pair with {peer} is wedged (injected fault)")
        return pair

    # -- pairs that break (not their peers) -----------------------------------------------------------
    def watch_pairs(self, store) -> None:
        """Watch thread: a pair the decode side broke (its down_key names the pair's generation)
        breaks here too; a broken pair whose peer still beats is formed anew (the next generation),
        so the cluster keeps its P->D path without a restart."""
        link = self.link
        with link.lock:
            live = [p for p in link.pairs.values() if p.dead is None]
            broken = dict(link.broken)
        for pair in live:
            key = down_key(link.ns, link.worker_id, link.incarnation, pair.peer, pair.peer_inc)
            if store.check([key]) and int(store.get(key)) >= pair.gen:
                link.mark_dead(pair.peer, f"the decode worker broke the pair (generation {pair.gen})", pair_only=True)
        for peer, hb in broken.items():
            try:
                beat = link.heartbeat_of(store, peer)
                if beat <= hb:
                    self._note_unformed(peer, hb, beat)
                    continue  # not seen beating since the pair broke (yet)
                self._unformed_since.pop((peer, hb), None)  # it beat: this break's wait is over
                link.forget_incarnation(peer, "re-forming a broken pair")
                with link.lock:
                    link.broken.pop(peer, None)
                collect_including_frozen()  # the old pair's channel goes now (gloo: its sockets close, the peer's receives end)
                self._pair(peer)
                log.warning("KV transport %s: the pair with %s re-formed (generation %d)", link.worker_id, peer,
                            link.pairs[peer].gen)
            except Exception as e:  # noqa: BLE001 - retried next heartbeat while the peer beats
                log.warning("KV transport %s: re-forming the pair with %s failed: %s", link.worker_id, peer, e)
                with link.lock:
                    if peer in link.dead_peers:
                        link.broken[peer] = hb

    def _note_unformed(self, peer: str, hb: int, beat: int) -> None:
        """Watch thread: a broken pair waits for its peer's next beat. Said once per break when that
        beat has not come within peer_timeout_s, with the counts: a peer that serves on without beating
        leaves the pair unformed for good (seen once in tests/reliability/test_chaos_faults.py)."""
        first = self._unformed_since.setdefault((peer, hb), time.monotonic())
        if first is not None and time.monotonic() - first > self.link.spec.peer_timeout_s:
            self._unformed_since[(peer, hb)] = None
            log.warning("KV transport %s: the pair with %s broke %.0f s ago and is not re-formed: its heartbeat "
                        "count is %d, %d when the pair broke", self.link.worker_id, peer, time.monotonic() - first,
                        beat, hb)

    def _open_pair(self, peer: str) -> Pair:
        """Any failure leaves the peer dead: its half of the channel may exist, ours never will."""
        link = self.link
        if peer in link.dead_peers:
            raise PeerDeadError(f"peer {peer} is marked dead: {link.dead_peers[peer]}")
        pair = Pair(peer, link.worker_id)
        try:
            raw = self._wait_key(link.store(), f"{link.ns}/ctl/{peer}", peer,
                                 time.monotonic() + link.spec.transfer_timeout_s, "its KV control endpoint")
            if raw is None:
                raise TimeoutError(f"decode worker {peer} never published its KV control endpoint "
                                   f"(within transfer_timeout_s={link.spec.transfer_timeout_s})")
            info = msgspec.msgpack.decode(raw)
            pair.peer_inc = info.get("incarnation", 0)
            check_pair_numerics(link.worker_id, link.numerics, peer, KVNumerics.from_dict(info.get("numerics")))
            with link.lock:  # a pair re-formed between the same incarnations takes the next generation
                gen = self._gens.get(peer)
                pair.gen = 0 if gen is None or gen[0] != pair.peer_inc else gen[1] + 1
                self._gens[peer] = (pair.peer_inc, pair.gen)
            theirs = PlanSpec.from_wire(info["layout"], peer)
            pair.spec = link.plan_spec.joined(theirs, "prefill")  # with the decode worker's tensor-parallel size
            pair.spec.check_peer(theirs.joined(link.plan_spec, "decode"), peer)
            pair.outbox = Outbox(info["endpoint"], link.spec.secret, receiver=f"{peer}.{pair.peer_inc}")
            events = self.payload.prepare(pair, info)
            pair.outbox.send(Hello(link.worker_id, pair.spec.to_wire(), events, link.incarnation, pair.gen))
            key = verdict_key(link.ns, link.worker_id, link.incarnation, peer, pair.peer_inc, pair.gen)
            verdict = self._wait_key(link.store(), key, peer, time.monotonic() + link.spec.transfer_timeout_s,
                                     "its answer to our hello", inc=pair.peer_inc)
            if verdict is None:
                raise TimeoutError(f"decode worker {peer} did not answer our hello within "
                                   f"transfer_timeout_s={link.spec.transfer_timeout_s}")
            link.store().delete_key(key)
            if verdict != b"ok":
                raise RuntimeError(f"decode worker {peer} refused the pair: {verdict.decode(errors='replace')}")

            def warm():
                with pair.io:
                    self.payload.warm(pair)
            # NOTE: the rendezvous blocks until the decode side joins; a peer that dies meanwhile
            # (the router tells us, or its heartbeat stops) fails it now, not at its own timeout.
            link.form_interruptibly(peer, warm, f"forming the KV pair with {peer}", inc=pair.peer_inc)
        except Exception as e:
            if pair.outbox is not None:
                pair.outbox.close()
            self.payload.release(pair)
            with link.lock:
                link.dead_peers.setdefault(peer, f"connecting failed: {type(e).__name__}: {e}")
            raise
        pair.waiter.start()
        with link.lock:
            link.pairs[peer] = pair
        return pair

    def _wait_key(self, store, key: str, peer: str, deadline: float, what: str, inc: int | None = None) -> bytes | None:
        """Connecting only (never on a transfer's path): polls until `key` exists; None at the deadline;
        raises if the peer died meanwhile, or (inc) if a later incarnation than `inc` of it started:
        our hello went to one that is gone and nobody will answer it."""
        link = self.link
        delay, next_live = 1e-4, 0.0
        while True:
            try:
                if store.check([key]):
                    return store.get(key)
            except dist.DistStoreError as e:  # this client is broken (see renew_store); not the peer
                log.warning("KV transport %s: store client failed waiting for %s (%s): a new one", link.worker_id, key, e)
                store = link.renew_store()
            now = time.monotonic()
            if now >= deadline:
                return None
            if link.closed.is_set():
                raise RuntimeError(f"KV transport of {link.worker_id} closed while waiting for {what}")
            if now >= next_live:
                link.check_alive(store, peer)
                if inc is not None:
                    link.check_incarnation(store, peer, inc)
                next_live = now + link.spec.heartbeat_s
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.05)

    # -- shipments ------------------------------------------------------------------------------------
    def begin(self, sends: Sequence[KVSend], layerwise: bool | None = None) -> Shipment:
        sh = _Shipment(self)
        groups: dict[str, list[KVSend]] = {}
        for s in sends:
            sh.futures[s.reservation.request_id] = Future()
            groups.setdefault(s.reservation.decode_worker_id, []).append(s)
        store = self.link.store()
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
                self.link.mark_dead(peer, f"opening a KV bundle failed: {type(e).__name__}: {e}", pair_only=True)
                continue
            if b is None:
                pair.order.release()
            else:
                sh.bundles.append(b)
        return sh

    def _check_send(self, s: KVSend) -> None:
        res, n, block_size = s.reservation, len(s.src_block_ids), self.link.block_size
        if res.decode_worker_id == self.link.worker_id:
            raise ValueError("a KV transfer to itself")
        if not 0 < n <= len(res.block_ids):
            raise ValueError(f"{n} source blocks for a reservation of {len(res.block_ids)}")
        if blocks_for_tokens(s.num_tokens, block_size) != n:
            raise ValueError(f"{s.num_tokens} tokens do not fill {n} blocks of {block_size}")

    def _claim(self, store, pair: Pair, res: Reservation, value: bytes) -> None:
        link = self.link
        key = claim_key(link.ns, link.worker_id, res.decode_worker_id, pair.peer_inc, res.transfer_seq)
        got = store.compare_set(key, "", value)
        if got == CANCEL:
            store.delete_key(key)
            raise TimeoutError(f"decode worker {res.decode_worker_id} gave up on transfer {res.transfer_seq} "
                               f"({res.request_id}) before it was sent (expect_timeout_s={link.spec.expect_timeout_s} "
                               "or cancelled); its blocks are back in its pool")
        if got != value:
            raise RuntimeError(f"transfer {res.transfer_seq} to {res.decode_worker_id} was already claimed")

    def _fail_send(self, fut: Future, s: KVSend, e: BaseException, peer: str) -> None:
        self.link.record("send", s.reservation.request_id, 0, 0.0, False, peer)
        fut.set_exception(e)

    def _open_bundle(self, store, pair: Pair, todo: list[KVSend], futures, layerwise) -> OutBundle | None:
        """Under pair.order: claims, plans and announces one bundle (None if nothing was claimed)."""
        link = self.link
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
        lw = layerwise if layerwise is not None else sum(s.num_tokens for s in claimed) >= link.spec.layerwise_min_tokens
        srcs = [tuple(s.src_block_ids) for s in claimed]
        items, launches = self.payload.plan(pair, srcs, [tuple(s.reservation.block_ids[:len(x)]) for s, x in zip(claimed, srcs)],
                                  lw)
        b = OutBundle(next(self._bundle_ids), pair, claimed, [futures[s.reservation.request_id] for s in claimed],
                       items, launches)
        msg = Begin(link.worker_id, b.id, lw, fingerprint(items, launches),
                    [(s.reservation.transfer_seq, s.reservation.request_id, s.num_tokens,
                      np.asarray(x, dtype="<i4").tobytes()) for s, x in zip(claimed, srcs)])
        with link.lock:
            pair.bundles.append(b)
        try:
            pair.outbox.send(msg)
        except Exception as e:  # noqa: BLE001 - the decode side never hears of these claims
            link.mark_dead(pair.peer, f"pushing a begin failed: {e}", pair_only=True, of=pair)
        return b

    def _issue_through(self, b: OutBundle, layer: int | None, ready) -> None:
        """Issues b's launches whose layers are all computed (every one when layer is None)."""
        pair = b.pair
        while b.issued < len(b.launches) and (layer is None or b.launches[b.issued].last_layer <= layer):
            if pair.dead is not None or b.failed is not None or pair.wedged:
                b.issued = len(b.launches)  # the channel is gone: nothing more can be sent
                break
            if b.fault is None and b.issued == 0:
                b.fault = next((k for k in ("transfer", "stuck_transfer")
                                if self.link.faults.take(k, pair) is not None), "")
            if b.fault == "stuck_transfer":
                # Injected: the pair's channel wedges here. Nothing of this bundle, nor anything
                # after it, goes out on the pair; its completion never comes (WedgedCompletion).
                pair.wedged = True
                b.issued = len(b.launches)
                break
            try:
                with pair.io:
                    self.payload.issue(pair, b, b.launches[b.issued], ready)
            except Exception as e:  # noqa: BLE001 - the pair's sends and receives no longer match
                b.failed = f"{type(e).__name__}: {e}"
                self.link.mark_dead(pair.peer, f"issuing a KV launch failed: {b.failed}", pair_only=True, of=pair)
                b.issued = len(b.launches)
                break
            b.issued += 1
            if b.fault == "transfer":  # injected: the pair dies mid-payload, after this first launch
                b.fault = ""
                self._kill_pair(pair, "injected fault: the KV pair was killed mid-payload")
        if b.issued == len(b.launches) and not b.unlocked:
            b.unlocked = True
            pair.order.release()

    def _kill_pair(self, pair: Pair, why: str) -> None:
        """The pair breaks here (fault "transfer"): its channel is torn down, it is marked dead (the
        pair only: re-formed while the peer lives), and the decode side is told at once (Broken)."""
        link = self.link
        with link.lock:
            bundles = list(pair.bundles)

        def broken() -> None:
            try:
                pair.outbox.send(Broken(link.worker_id, pair.gen, why))
            except Exception:  # noqa: BLE001 - it finds out from its receives
                pass
            link.mark_dead(pair.peer, why, pair_only=True, of=pair)
        with pair.io:
            try:
                self.payload.kill(pair, bundles, broken)
            except Exception:  # noqa: BLE001
                log.exception("tearing down the KV channel to %s failed", pair.peer)
                broken()

    def _seal(self, b: OutBundle) -> None:
        b.t_kv = time.monotonic()
        if b.pair.wedged and b.completion is None:
            b.completion = WedgedCompletion()  # (fault "stuck_transfer") done once the pair is given up
            return
        try:
            with b.pair.io:
                b.completion, b.commit_event = self.payload.seal(b.pair, b)
        except Exception as e:  # noqa: BLE001
            b.failed = b.failed or f"{type(e).__name__}: {e}"
            b.completion = ReadyCompletion()
            self.link.mark_dead(b.pair.peer, f"sealing a KV bundle failed: {b.failed}", pair_only=True, of=b.pair)

    def _commit(self, b: OutBundle, first_tokens: Mapping[str, int | None],
                logprobs: Mapping[str, PrefillLogprobs]) -> None:
        toks = [first_tokens.get(s.reservation.request_id) for s in b.sends]
        lps = [logprobs.get(s.reservation.request_id) for s in b.sends] if logprobs else []
        msg = Commit(self.link.worker_id, b.id, [-1 if tok is None else int(tok) for tok in toks],
                     [tok is not None for tok in toks], b.commit_event, lps if any(lp is not None for lp in lps) else [])
        if b.pair.dead is None:
            try:
                b.pair.outbox.send(msg)
            except Exception as e:  # noqa: BLE001
                self.link.mark_dead(b.pair.peer, f"pushing a commit failed: {e}", pair_only=True, of=b.pair)
        b.pair.waiter.put(b.completion, lambda: self._finish_out(b))

    def _finish_out(self, b: OutBundle) -> None:
        """Waiter thread: this side's payload is done (or the pair died): resolve the futures."""
        link = self.link
        seconds = time.monotonic() - b.t_kv
        err = b.failed or b.completion.error()
        if err is not None:
            link.mark_dead(b.pair.peer, f"a KV payload failed: {err}", pair_only=True, of=b.pair)
        with link.lock:
            if b in b.pair.bundles:
                b.pair.bundles.remove(b)
        for s, fut in zip(b.sends, b.futures):
            rid = s.reservation.request_id
            if err is not None:
                link.record("send", rid, 0, seconds, False, b.pair.peer)
                exc = PeerDeadError if "PeerDeadError" in err else RuntimeError
                fut.set_exception(exc(f"KV transfer {s.reservation.transfer_seq} ({rid}) to {b.pair.peer} failed: {err}"))
            else:
                fut.set_result(link.record("send", rid, len(s.src_block_ids) * link.bytes_per_block, seconds, True,
                                        b.pair.peer))

    def watch_outgoing(self, store) -> None:
        """Watch thread: a peer with transfers in flight must stay alive and finish them in time."""
        link = self.link
        now = time.monotonic()
        with link.lock:
            busy = [(p, list(p.bundles)) for p in link.pairs.values() if p.bundles and p.dead is None]
        for pair, bundles in busy:
            try:
                link.check_alive(store, pair.peer)
            except PeerDeadError as e:
                link.mark_dead(pair.peer, str(e))
                continue
            for b in bundles:
                if b.t_kv and b.completion is not None and not b.completion.done() \
                        and now - b.t_kv > link.spec.transfer_timeout_s:
                    link.mark_dead(pair.peer, f"a KV payload was not done within transfer_timeout_s="
                                           f"{link.spec.transfer_timeout_s}", pair_only=True, of=pair)
                    break

    def send_abort(self, reservation: Reservation, request_id: str, timeout_s: float) -> None:
        if reservation.request_id != request_id:
            raise ValueError(f"abort of {request_id} for the reservation of {reservation.request_id}")
        pair = self._pair(reservation.decode_worker_id)
        self._claim(self.link.store(), pair, reservation, ABORT)
        pair.outbox.send(Abort(self.link.worker_id, reservation.transfer_seq, request_id))
        self.link.record("send", request_id, 0, 0.0, True, pair.peer)
