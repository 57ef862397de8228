"""KV payload over torch.distributed point-to-point: NCCL between GPUs, gloo between CPU caches.

Every (prefill, decode) pair has its own two-rank process group (prefill = rank 0, decode = rank 1),
formed and warmed when the pair connects (the prefill's hello; the launcher connects every pair before
/ready) through a PrefixStore of the cluster's store. Why not one world group: NCCL communicators can't
be recovered after a timeout and a gloo error poisons its whole context, so one dead peer would take
every transfer of the process down. Per pair, a dead peer is aborted alone.

Payload. A paged block set is many small strided pieces (a block's K or V of one layer: 32 KiB for
the 8B shape), and NCCL's per-message cost makes sending them in place a fraction of the wire rate. So
every launch of the plan (plan.py: a layer group of the bundle's blocks, within one staging slot) is
gathered by one fused kernel (block_copy.py; HBM is ~10x NVLink) into a slot of the pair's staging
ring (staging.py), sent as ONE contiguous message, received into the peer's slot and scattered into
the reserved blocks by the same kernel. Layer-wise bundles issue each launch once its layers' K/V is
written (the shipment's layer_done), so shipping overlaps the rest of the forward.

Streams (CUDA). Each pair has its own stream on each side. ProcessGroupNCCL runs every op on its
internal stream after making it wait for the stream current at the call (our pair stream), and
`work.wait()` makes the *current* stream wait for NCCL: we only call it with the pair stream current.
So the prefill's compute stream never waits for a send, the decode's graph stream never waits for a
receive, and completion is one event recorded on the pair stream (completion.py).
  sender, launch k in slot s:  pair stream waits for the send that last read s (ring.last), gathers
                               into s, sends s (NCCL waits for the gather). Gather k+1 thus runs while
                               send k is on the wire, and sends queue back to back on NCCL's stream.
  receiver, launch k in slot s: receive k is posted before the scatter of k-1 is enqueued, and the
                               scatter that last read s (launch k - slots <= k - 2) is already on the
                               pair stream, so NCCL's wait at the receive orders it after that scatter;
                               then the pair stream waits for receive k-1 and scatters it. The decode
                               side posts a whole bundle when its Begin arrives (before the prefill's
                               forward ends), so receives are up before the bytes come.
One launch is one coalesced group (`_start_coalescing` .. `_end_coalescing`: one NCCL kernel per side,
on the PG's own two-rank communicator; the warm-up uses the same path so that communicator exists
before the first transfer).

Tensor parallelism (tp_payload.py): a pair of a TP-N prefill worker and a TP-M decode worker moves its
KV over the head mapping's links (plan.py: PlanSpec.links), each link a two-rank group of its own
between one prefill rank and one decode rank, with its own stream and staging ring on each side
(`_Link`, one per link a rank serves: `pair.payload` maps link index -> `_Link`). Every launch names its
link; a rank issues and posts only its own links' launches. A link that moves part of a rank's heads
gathers and scatters them with the head-range copy (head_copy.py); a whole link (N = M) copies whole
blocks. The code here runs on every rank: rank 0's inside its worker's TPPayload, the followers' inside
the payload agents that rank 0 drives (tp_payload.py); without tensor parallelism a worker's transport
holds one TorchDistPayload with one whole link, link 0.

gloo (CPU caches, tests, the same plan and ring): a gloo op blocks the thread that waits for it, so
the pair's waiter thread does the payload work in order (completion.HostCompletion): on the prefill
side each launch (wait for the send that last read the slot, gather, send) as the shipment issues it,
never the forward's thread; on the decode side a bundle's receives, at most `slots` posted at a time,
each scattered once it arrived and its slot then reused. Gather and scatter are the torch reference of
the copy kernel.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from cluster.transport.block_copy import copy_blocks
from cluster.transport.completion import AllCompletion, EventCompletion, HostCompletion, ReadyCompletion
from cluster.transport.head_copy import copy_block_heads
from cluster.transport.pair import Pair, PeerDeadError
from cluster.transport.payload import KVPayload, PayloadEnd
from cluster.transport.plan import HeadLink, Launch, bundle_blocks, plan_item, plan_launches
from cluster.transport.rendezvous_store import local_address_towards
from cluster.transport.staging import StagingBudget, StagingRing
from cluster.worker.startup_heap import collect_including_frozen

_PAIR_RANK = {"prefill": 0, "decode": 1}


def _coalescing(pg, method: str, device):
    """pg._start_coalescing() / pg._end_coalescing() on the backend object (ProcessGroupNCCL binds
    them without arguments); the ProcessGroup wrapper's binding takes the device instead."""
    try:
        return getattr(pg, method)()
    except TypeError:  # raised by the binding's signature check, before anything ran
        return getattr(pg, method)(device)


def _noop() -> None:
    pass


class _WaitOnce:
    """A gloo work, waited at most once. HAZARD: gloo's wait() on a send that already finished waits
    for the buffer's NEXT send (its unbound buffer counts completions), so a second wait hangs: the
    sender waits for a slot's last send before reusing it, and again for every send at the seal."""

    def __init__(self, work):
        self.work, self.waited, self.failure = work, False, None

    def wait(self) -> None:
        if not self.waited:
            self.waited = True
            try:
                self.work.wait()
            except Exception as e:  # noqa: BLE001 - raised again to every later waiter
                self.failure = e
        if self.failure is not None:
            raise self.failure


@dataclass
class _Link:
    """One link of a pair (without tensor parallelism: the pair's only one): its process group, and this
    side's stream (CUDA) and staging ring, and where its heads sit in this side's cache."""

    reserved: int  # bytes of this worker's StagingBudget held for the ring (0 once given back)
    index: int = 0  # in the pair's PlanSpec.links
    head0: int = 0  # this side's first local head of the link
    heads: int = 0  # the link's heads
    whole: bool = True  # every head of both sides' caches: whole-block copies
    pg: object = None
    store: object = None  # the pg's store. HAZARD: a Python store (AuthenticatedStore) must outlive its
    # pg: NCCL reaches it lazily, at the first op, and a collected one fails there ("Not implemented")
    peer_rank: int = 0
    stream: torch.cuda.Stream | None = None
    ring: StagingRing | None = None


@dataclass
class _BundleIO:
    """One bundle's payload state on this side."""

    ids: torch.Tensor | None = None  # this side's block ids in plan order, on the cache's device
    works: dict = field(default_factory=dict)  # link index -> its works, in order
    error: str | None = None  # gloo sender: the first launch that failed on the pair's thread
    keep: list = field(default_factory=list)  # tensors the payload reads until its completion (CUDA ids)
    link_ids: dict = field(default_factory=dict)  # CUDA sender: link index -> block ids on its stream

    def all_works(self) -> list:
        return [w for ws in self.works.values() for w in ws]


class TorchDistPayload(KVPayload):
    """The torch_dist payload of one rank: a worker's own (factory.py), rank 0's links under tensor
    parallelism (TPPayload holds one) and each follower's (its PayloadAgent holds one)."""

    def __init__(self, end: PayloadEnd):
        self.spec, self.kv_cache = end.spec, end.kv_cache
        self.worker_id, self.role, self.incarnation, self.tp_rank = end.worker_id, end.role, end.incarnation, end.tp_rank
        self.ns = end.spec.namespace
        self._new_store = end.new_store
        self.lock = threading.Lock()  # guards each link's `reserved` (released once, by whichever comes first)
        self.backend = self.spec.backend
        cuda = self.kv_cache.is_cuda
        if self.backend == "nccl" and not cuda:
            raise ValueError("the nccl backend needs a KV cache on a CUDA device")
        if self.backend == "gloo" and cuda:
            raise ValueError("KV caches on a GPU move over nccl (gloo carries CPU caches only)")
        self.staging = StagingBudget(self.spec.staging_cap_bytes)

    def plan_kind(self) -> tuple[str, int]:
        return f"torch_dist/{self.backend}", self.spec.staging_bytes

    def plan(self, pair, srcs, dsts, layerwise):
        items = [plan_item(s, d) for s, d in zip(srcs, dsts)]
        return items, plan_launches(pair.spec, sum(it.n for it in items))

    def metrics(self) -> dict:
        return {"staging_bytes": self.staging.reserved, "staging_rings": self.staging.rings}

    def my_links(self, spec) -> list[tuple[int, HeadLink]]:
        """The pair's links this rank is an end of."""
        side = "prefill_rank" if self.role == "prefill" else "decode_rank"
        return [(i, x) for i, x in enumerate(spec.links) if getattr(x, side) == self.tp_rank]

    # -- the pair's channel ---------------------------------------------------------------------------
    def _form(self, peer: str, peer_inc: int, gen: int, link: _Link) -> None:
        # The rendezvous is per pair of incarnations (a restarted worker never meets its old keys), per
        # generation of their pair (a broken pair formed anew never meets them either) and per link
        # (each a two-rank group between one rank of each side).
        me, them = f"{self.worker_id}.{self.incarnation}", f"{peer}.{peer_inc}"
        prefill, decode = (me, them) if self.role == "prefill" else (them, me)
        # (AuthenticatedStore.prefixed: torch's PrefixStore cannot wrap a Python store)
        store = self._new_store().prefixed(f"{self.ns}/pg/{prefill}/{decode}/g{gen}/L{link.index}/")
        rank = _PAIR_RANK[self.role]
        if self.backend == "nccl":
            # NCCL's watchdog must never be the first to act on a slow transfer: our deadlines are
            # transfer_timeout_s, then we abort the pair ourselves.
            timeout = datetime.timedelta(seconds=4 * self.spec.transfer_timeout_s)
            # 2 = abort the communicator on an error the watchdog finds, but never kill the process
            # (the default, 3, would take a worker down with one dead peer).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(self.kv_cache.device)
            pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
            stream = torch.cuda.Stream(self.kv_cache.device)
        else:
            # gloo fails an op as soon as the peer's socket closes (a dead process), else at this
            # timeout (a hung one): that is what ends a transfer with a dead gloo peer (see abort).
            timeout = datetime.timedelta(seconds=2 * self.spec.transfer_timeout_s)
            host = self.spec.bind_host or local_address_towards(self.spec.store_host or "127.0.0.1", self.spec.store_port)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            pg = dist.ProcessGroupGloo(store, rank, 2, opts)  # blocks until both ranks joined
            stream = None
        link.pg, link.store, link.peer_rank, link.stream = pg, store, 1 - rank, stream

    def reserve(self, pair: Pair) -> None:
        """Before the pair is answered (decode) or greeted (prefill): this side's ring of each of its
        links, counted against staging_cap_bytes (raises past it: the pair is refused, both sides know
        at once)."""
        ring_bytes = self.spec.staging_slots * self.spec.staging_bytes
        side = "src" if self.role == "prefill" else "dst"
        links = {}
        try:
            for i, x in self.my_links(pair.spec):
                self.staging.reserve(ring_bytes, pair.peer)
                h0, n = x.heads(side)
                links[i] = _Link(ring_bytes, i, h0, n, x.whole)
        except Exception:
            for link in links.values():
                self.staging.release(link.reserved)
            raise
        pair.payload = links

    def open_links(self, pair: Pair, send: bool) -> None:
        """Forms each of this rank's links of the pair, allocates its staging ring, and moves one tiny
        transfer through the real path (forms the NCCL communicator, compiles the copy kernel). Links in
        index order on every rank: the lowest link not formed yet always has both ends forming it."""
        for link in pair.payload.values():
            self._form(pair.peer, pair.peer_inc, pair.gen, link)
            with self._on_stream(link.stream):  # the ring belongs to the pair stream's allocator pool
                link.ring = StagingRing(self.spec.staging_slots, self.spec.staging_bytes, self.kv_cache.device)
            self._warm(pair, link, send)

    def _p2p(self, link: _Link, msgs: list[torch.Tensor], send: bool) -> list:
        pg = link.pg
        if self.backend == "nccl":
            dev = self.kv_cache.device
            _coalescing(pg, "_start_coalescing", dev)
            try:
                for m in msgs:
                    (pg.send if send else pg.recv)([m], link.peer_rank, 0)
            finally:
                work = _coalescing(pg, "_end_coalescing", dev)
            return [work]
        return [_WaitOnce((pg.send if send else pg.recv)([m], link.peer_rank, tag)) for tag, m in enumerate(msgs)]

    def _warm(self, pair: Pair, link: _Link, send: bool) -> None:
        cache = self.kv_cache
        one = Launch(0, 1, 0, 1, link.index)
        with self._on_stream(link.stream):
            raw, view = link.ring.slot(0, one, one.nbytes(pair.spec), cache, link.heads)
            works = self._p2p(link, [raw], send)
            for w in works:
                w.wait()
            ids = torch.zeros(1, dtype=torch.int32, device=cache.device)
            self._gather(link, view, cache[0:1], ids)  # gather and scatter the NULL block onto itself
            self._scatter(link, cache[0:1], ids, view)
            if link.stream is None:
                return
            link.stream.synchronize()
        err = EventCompletion(torch.cuda.Event(), works).error()
        if err is not None:
            raise RuntimeError(f"warm-up transfer failed: {err}")

    def prepare(self, pair: Pair, info: dict) -> list[bytes]:
        self.reserve(pair)
        return []

    def warm(self, pair: Pair) -> None:
        self.open_links(pair, send=True)

    def admit(self, pair: Pair, hello) -> None:
        self.reserve(pair)

    def accept(self, pair: Pair, hello) -> None:
        self.open_links(pair, send=False)

    def abort(self, pair: Pair) -> None:
        """NCCL: ncclCommAbort ends the kernels in flight, so the pair stream (and the bundles'
        completion events) move on. gloo: nothing; its abort() neither wakes an op in flight nor lets
        it see the peer's socket close any more, while left alone the op fails at that close or at the
        group's timeout (the pair's thread then stops: it posts and sends nothing for a dead pair)."""
        if pair.payload is None or self.backend != "nccl":
            return
        for link in pair.payload.values():
            if link.pg is not None:
                link.pg.abort()

    def kill(self, pair: Pair, bundles: list, then) -> None:
        """Fault injection ("transfer"): NCCL, the abort. gloo has no way to end a peer's operation in
        flight but closing the sockets, which it does once nothing references the group any more: on
        the pair's thread, in order after the launches issued so far, their sends are waited for (the
        decode side posted those receives at the Begin), the rings are given back and the groups of
        this rank's links dropped, so the decode side's later receives fail at once ("Connection
        closed by peer"); then `then()`. Launches after it fail (no ring)."""
        if self.backend == "nccl":
            self.abort(pair)
            then()
            return
        links = list(pair.payload.values()) if pair.payload else []

        def kill() -> None:
            for b in bundles:
                io = b.payload
                if io is None:
                    continue
                for w in io.all_works():
                    try:
                        w.wait()
                    except Exception:  # noqa: BLE001 - it failed: nothing left in flight
                        pass
                io.works.clear()  # (the works hold the groups)
                io.error = io.error or "the pair was killed (injected fault)"
            self.release(pair)
            for link in links:
                link.pg = link.ring = None
            collect_including_frozen()
            then()
        pair.waiter.put(HostCompletion(kill), _noop)

    def release(self, pair: Pair) -> None:
        if pair.payload is None:
            return
        for link in pair.payload.values():
            with self.lock:  # once, whichever of close() and a peer's restart comes first
                reserved, link.reserved = link.reserved, 0
            if reserved:
                link.ring = None  # CUDA: NCCL recorded its streams on the slots; the allocator waits for them
                self.staging.release(reserved)

    # -- gather and scatter of a link's heads ------------------------------------------------------------
    def _gather(self, link: _Link, view: torch.Tensor, src: torch.Tensor, ids: torch.Tensor) -> None:
        """view [layers, 2, n, bs, link heads, hd] <- the link's heads of blocks `ids` of src."""
        if link.whole:
            copy_blocks(view, None, src, ids)
        else:
            copy_block_heads(view, None, 0, src, ids, link.head0, link.heads)

    def _scatter(self, link: _Link, dst: torch.Tensor, ids: torch.Tensor, view: torch.Tensor) -> None:
        if link.whole:
            copy_blocks(dst, ids, view, None)
        else:
            copy_block_heads(dst, ids, link.head0, view, None, 0, link.heads)

    # -- both sides -------------------------------------------------------------------------------------
    def _upload(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the cache's device: on CUDA one pinned, non-blocking copy on the current (pair)
        stream. NOTE: never a pageable copy here: it would sync the host with the device."""
        if not self.kv_cache.is_cuda:
            return torch.tensor(ids, dtype=torch.int64)
        return torch.tensor(ids, dtype=torch.int32).pin_memory().to(self.kv_cache.device, non_blocking=True)

    def _slot(self, pair: Pair, link: _Link, launch: Launch):
        if link.ring is None:  # released: this transport closed, or the peer restarted
            raise PeerDeadError("the pair's channel is closed")
        k = link.ring.take()
        return (k,) + link.ring.slot(k, launch, launch.nbytes(pair.spec), self.kv_cache, link.heads)

    # -- prefill side -----------------------------------------------------------------------------------
    def issue(self, pair: Pair, b, launch: Launch, ready) -> None:
        link = pair.payload.get(launch.link)
        if link is None:
            return  # another rank's link (tensor parallelism): that rank issues it
        if b.payload is None:
            b.payload = _BundleIO()
        io: _BundleIO = b.payload
        if link.stream is None:  # gloo: the pair's thread, in order (a wait for a slot blocks no forward)
            pair.waiter.put(HostCompletion(partial(self._send_on_host, pair, b, launch)), _noop)
            return
        with self._on_stream(link.stream):
            if ready is not None:
                link.stream.wait_event(ready)  # the layers this launch carries are computed
            ids = io.link_ids.get(link.index)
            if ids is None:  # uploaded on this link's stream, which alone reads it
                ids = io.link_ids[link.index] = self._upload(bundle_blocks(b.items, "src"))
            k, raw, view = self._slot(pair, link, launch)
            if link.ring.last[k] is not None:
                link.ring.last[k].wait()  # the pair stream waits for the send that last read this slot
            self._gather(link, view, self.kv_cache[launch.l0:launch.l1], ids[launch.b0:launch.b1])
            works = self._p2p(link, [raw], send=True)
            link.ring.last[k] = works[-1]
            io.works.setdefault(link.index, []).extend(works)

    def _send_on_host(self, pair: Pair, b, launch: Launch) -> None:
        """gloo, the pair's waiter thread: one launch. A failure is the bundle's (seal reports it)."""
        io: _BundleIO = b.payload
        if io.error is not None:
            return
        link = pair.payload[launch.link]
        try:
            if pair.dead is not None:
                raise PeerDeadError(f"peer {pair.peer} is marked dead: {pair.dead}")
            if io.ids is None:
                io.ids = self._upload(bundle_blocks(b.items, "src"))
            k, raw, view = self._slot(pair, link, launch)
            last = link.ring.last[k]
            if last is not None:
                last.wait()  # the send that last read this slot is done (or raises: the pair broke)
            self._gather(link, view, self.kv_cache[launch.l0:launch.l1], io.ids[launch.b0:launch.b1])
            works = self._p2p(link, [raw], send=True)
            link.ring.last[k] = works[-1]
            io.works.setdefault(link.index, []).extend(works)
        except Exception as e:  # noqa: BLE001 - the pair's sends and receives no longer match
            io.error = f"{type(e).__name__}: {e}"

    def seal(self, pair: Pair, b):
        io = b.payload or _BundleIO()
        if not pair.payload:  # no link of this pair on this rank (tensor parallelism)
            return ReadyCompletion(), -1
        if next(iter(pair.payload.values())).stream is None:
            return HostCompletion(partial(self._sent_on_host, io), io), -1
        parts = []
        for link in pair.payload.values():
            works = io.works.get(link.index, [])
            with self._on_stream(link.stream):
                if works:
                    works[-1].wait()  # one PG's sends run in order on NCCL's stream: the last one is the end
                ev = torch.cuda.Event(blocking=True)
                ev.record(link.stream)
            parts.append(EventCompletion(ev, works, io))
        return (parts[0] if len(parts) == 1 else AllCompletion(parts)), -1

    @staticmethod
    def _sent_on_host(io: _BundleIO) -> None:
        """gloo, the pair's waiter thread, after the bundle's launches: its sends are done."""
        for w in io.all_works():
            w.wait()
        if io.error is not None:
            raise RuntimeError(f"a launch failed: {io.error}")

    # -- decode side ------------------------------------------------------------------------------------
    def post(self, pair: Pair, b):
        io = b.payload = _BundleIO()
        if not pair.payload:  # no link of this pair on this rank (tensor parallelism)
            return ReadyCompletion(), None
        if next(iter(pair.payload.values())).stream is None:
            return HostCompletion(partial(self._receive_on_host, pair, b, io), io), None
        err, parts = None, []
        for link in pair.payload.values():
            with self._on_stream(link.stream):
                try:
                    ids = self._upload(bundle_blocks(b.items, "dst"))  # on this link's stream (one per link)
                    pending = None
                    for launch in b.launches:
                        if launch.link != link.index:
                            continue
                        _, raw, view = self._slot(pair, link, launch)
                        works = self._p2p(link, [raw], send=False)  # ordered after every scatter enqueued so far
                        io.works.setdefault(link.index, []).extend(works)
                        if pending is not None:
                            self._land(ids, link, *pending)
                        pending = (works, launch, view)
                    if pending is not None:
                        self._land(ids, link, *pending)
                    io.keep.append(ids)
                except Exception as e:  # noqa: BLE001 - the completion still covers what was posted
                    err = err or f"{type(e).__name__}: {e}"
                ev = torch.cuda.Event(blocking=True)
                ev.record(link.stream)
            parts.append(EventCompletion(ev, io.works.get(link.index, []), io))
        return (parts[0] if len(parts) == 1 else AllCompletion(parts)), err

    def _land(self, ids: torch.Tensor, link: _Link, works, launch: Launch, view) -> None:
        """CUDA: the link's stream (current) waits for a receive, then scatters its slot."""
        for w in works:
            w.wait()
        self._scatter(link, self.kv_cache[launch.l0:launch.l1], ids[launch.b0:launch.b1], view)

    def _receive_on_host(self, pair: Pair, b, io: _BundleIO) -> None:
        """gloo, the pair's waiter thread: the bundle's receives, link after link, at most one per slot
        in flight, each scattered once it arrived (then its slot takes the next). Bundles run one after
        another here, so every slot is free when one starts."""
        io.ids = self._upload(bundle_blocks(b.items, "dst"))
        for link in pair.payload.values():
            posted: deque = deque()
            todo = deque(la for la in b.launches if la.link == link.index)
            slots = len(link.ring.bufs)
            while todo or posted:
                while todo and len(posted) < slots:
                    if pair.dead is not None:  # the prefill sends nothing more: a receive would only wait
                        raise PeerDeadError(f"peer {pair.peer} is marked dead: {pair.dead}")
                    launch = todo.popleft()
                    _, raw, view = self._slot(pair, link, launch)
                    works = self._p2p(link, [raw], send=False)
                    io.works.setdefault(link.index, []).extend(works)
                    posted.append((works, launch, view))
                works, launch, view = posted.popleft()
                for w in works:
                    w.wait()
                self._scatter(link, self.kv_cache[launch.l0:launch.l1], io.ids[launch.b0:launch.b1], view)
