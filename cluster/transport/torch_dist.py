"""KV payload over torch.distributed point-to-point: NCCL between GPUs, gloo between CPU caches.

Every (prefill, decode) pair has its own two-rank process group (prefill = rank 0, decode = rank 1),
formed and warmed when the pair connects (the prefill's hello; the launcher connects every pair before
/ready) through a PrefixStore of the cluster's store. Why not one world group: NCCL communicators can't
be recovered after a timeout and a gloo error poisons its whole context, so one dead peer would take
every transfer of the process down. Per pair, a dead peer is aborted alone.

Streams (CUDA). Each pair has its own stream on each side. ProcessGroupNCCL runs every op on its
internal stream after making it wait for the stream current at the call (our pair stream: gathers and
earlier receives done), and `work.wait()` makes the *current* stream wait for NCCL: we only call it
with the pair stream current. So the prefill's compute stream never waits for a send, the decode's graph
stream never waits for a receive, and completion is one event recorded on the pair stream (control.py).
ProcessGroupNCCL calls recordStream on every p2p tensor, and the bundle holds them until that event.

Launches (plan.py). One coalesced group per launch (`_start_coalescing` .. `_end_coalescing`: one NCCL
kernel per side, on the PG's own two-rank communicator; the warm-up uses the same path so that
communicator exists before the first transfer). Direct messages are views of the caches; staged ones
go through a two-slot staging ring per pair and side, allocated once: the sender makes its pair stream
wait for the send that last read a slot before gathering into it; the receiver posts launch k+1 before
scattering launch k, so the scatter that last read k+1's slot (launch k-1) is queued before that
receive, which waits for it. A long transfer thus pipelines gather, wire and scatter.

gloo (CPU caches, tests): the same messages as async gloo ops; a pair's waiter thread waits for the
receives and runs the scatters.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from cluster.transport.block_copy import copy_blocks
from cluster.transport.completion import EventCompletion, HostCompletion
from cluster.transport.control import ControlledTransport, local_address_towards
from cluster.transport.pair import Pair
from cluster.transport.plan import Launch, plan_item, plan_launches

_PAIR_RANK = {"prefill": 0, "decode": 1}


def _coalescing(pg, method: str, device):
    """pg._start_coalescing() / pg._end_coalescing() on the backend object (ProcessGroupNCCL binds
    them without arguments); the ProcessGroup wrapper's binding takes the device instead."""
    try:
        return getattr(pg, method)()
    except TypeError:  # raised by the binding's signature check, before anything ran
        return getattr(pg, method)(device)


@dataclass
class _Link:
    """One pair's process group and this side's stream and staging ring."""

    pg: object
    peer_rank: int
    stream: torch.cuda.Stream | None
    slots: list = field(default_factory=lambda: [None, None])  # uint8 staging buffers (CUDA)
    slot_work: list = field(default_factory=lambda: [None, None])  # sender: the send that last read a slot
    next_slot: int = 0
    last_slot: int = 0


@dataclass
class _BundleIO:
    ids: dict  # item -> this side's block ids on the device (staged items only)
    works: list = field(default_factory=list)
    keep: list = field(default_factory=list)


class TorchDistTransport(ControlledTransport):
    def _setup_payload(self) -> None:
        self.backend = self.spec.backend
        cuda = self.kv_cache.is_cuda
        if self.backend == "nccl" and not cuda:
            raise ValueError("the nccl backend needs a KV cache on a CUDA device")
        if self.backend == "gloo" and cuda:
            raise ValueError("KV caches on a GPU move over nccl (gloo carries CPU caches only)")

    def _plan(self, srcs, dsts, layerwise):
        items = [plan_item(s, d, self.plane_block_bytes, self.spec.direct_min_bytes) for s, d in zip(srcs, dsts)]
        return items, plan_launches(items, self.num_layers, self.plane_block_bytes, layerwise, self.spec.staging_bytes)

    # -- the pair's channel ---------------------------------------------------------------------------
    def _form(self, peer: str, peer_inc: int, gen: int = 0) -> _Link:
        # The rendezvous is per pair of incarnations and per generation of their pair: a restarted
        # worker, or a broken pair formed anew, never meets old keys.
        me, them = f"{self.worker_id}.{self.incarnation}", f"{peer}.{peer_inc}"
        prefill, decode = (me, them) if self.role == "prefill" else (them, me)
        store = dist.PrefixStore(f"{self.ns}/pg/{prefill}/{decode}/g{gen}/", self._new_store())
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
            # timeout (a hung one): that is what ends a transfer with a dead gloo peer (see _payload_abort).
            timeout = datetime.timedelta(seconds=2 * self.spec.transfer_timeout_s)
            host = self.spec.bind_host or local_address_towards(self.spec.store_host or "127.0.0.1", self.spec.store_port)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            pg = dist.ProcessGroupGloo(store, rank, 2, opts)  # blocks until both ranks joined
            stream = None
        return _Link(pg, 1 - rank, stream)


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
        return [(pg.send if send else pg.recv)([m], link.peer_rank, tag) for tag, m in enumerate(msgs)]

    def _warm(self, link: _Link, send: bool) -> None:
        """One tiny message through the real path (forms the NCCL communicator), and the copy kernel
        compiled for this cache, both before the first transfer."""
        cache = self.kv_cache
        with self._on_stream(link.stream):
            one = torch.zeros((1,) + tuple(cache.shape[3:]), dtype=cache.dtype, device=cache.device)
            works = self._p2p(link, [one], send)
            if link.stream is None:
                for w in works:
                    w.wait()
                return
            for w in works:
                w.wait()
            ids = torch.zeros(1, dtype=torch.int32, device=cache.device)
            staging = torch.empty((1, 2, 1) + tuple(cache.shape[3:]), dtype=cache.dtype, device=cache.device)
            copy_blocks(staging, None, cache[0:1], ids)  # gather and scatter the NULL block onto itself
            copy_blocks(cache[0:1], ids, staging, None)
            link.stream.synchronize()
        err = EventCompletion(torch.cuda.Event(), works).error()
        if err is not None:
            raise RuntimeError(f"warm-up transfer failed: {err}")

    def _payload_prepare(self, pair: Pair, info: dict) -> list[bytes]:
        return []

    def _payload_warm(self, pair: Pair) -> None:
        pair.payload = self._form(pair.peer, pair.peer_inc, pair.gen)
        self._warm(pair.payload, send=True)

    def _payload_accept(self, pair: Pair, hello) -> None:
        pair.payload = self._form(pair.peer, pair.peer_inc, pair.gen)
        self._warm(pair.payload, send=False)

    def _payload_abort(self, pair: Pair) -> None:
        """NCCL: ncclCommAbort ends the kernels in flight, so the pair stream (and the bundles'
        completion events) move on. gloo: nothing; its abort() neither wakes an op in flight nor lets
        it see the peer's socket close any more, while left alone the op fails at that close or at the
        group's timeout."""
        link = pair.payload
        if link is not None and self.backend == "nccl":
            link.pg.abort()

    def _payload_kill(self, pair: Pair, bundles: list) -> None:
        """Fault injection ("transfer"): NCCL, the abort. gloo has no way to end a peer's operation in
        flight but closing the sockets, which it does once nothing references the group any more:
        the sends issued so far are waited for, then this side drops the group and its works, and the
        decode side's pending receives fail at once ("Connection closed by peer")."""
        if self.backend == "nccl":
            self._payload_abort(pair)
            return
        for b in bundles:
            if b.payload is not None:
                for w in b.payload.works:
                    try:
                        w.wait()
                    except Exception:  # noqa: BLE001 - it failed: nothing left in flight
                        pass
                b.payload = None
        pair.payload = None
        gc.collect()

    # -- messages -------------------------------------------------------------------------------------
    def _ids(self, b, side: str) -> dict[int, torch.Tensor]:
        """This side's block ids of the staged items, on the device: one pinned upload per bundle."""
        staged = [k for k, it in enumerate(b.items) if it.runs is None]
        if not staged:
            return {}
        lists = [b.items[k].src if side == "src" else b.items[k].dst for k in staged]
        flat = torch.tensor([x for ids in lists for x in ids], dtype=torch.int32)
        if self.kv_cache.is_cuda:  # NOTE: pinned + non_blocking: no host sync (the issue's pageable copy)
            flat = flat.pin_memory().to(self.kv_cache.device, non_blocking=True)
        out, o = {}, 0
        for k, ids in zip(staged, lists):
            out[k] = flat[o:o + len(ids)]
            o += len(ids)
        return out

    def _slot(self, link: _Link, nbytes: int, sender: bool) -> torch.Tensor:
        if link.stream is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        k = link.next_slot
        link.next_slot ^= 1
        if sender and link.slot_work[k] is not None:
            link.slot_work[k].wait()  # the pair stream waits until the send that read this slot is done
        if link.slots[k] is None or link.slots[k].numel() < nbytes:
            # Allocated on the pair stream (current): only work ordered after it reuses the memory.
            link.slots[k] = torch.empty(max(nbytes, self.spec.staging_bytes), dtype=torch.uint8, device=self.kv_cache.device)
        link.last_slot = k
        return link.slots[k]

    def _messages(self, link: _Link, b, launch: Launch, side: str, ids: dict):
        """(messages in plan order, scatters to run once they arrived). The sender gathers staged
        segments into its slot here, on the current (pair) stream."""
        cache, sender = self.kv_cache, side == "src"
        msgs, scatters = [], []
        nbytes = sum(b.items[s.item].staged_bytes(s.l1 - s.l0, self.plane_block_bytes) for s in launch)
        slot = self._slot(link, nbytes, sender) if nbytes else None
        off = 0
        for seg in launch:
            it = b.items[seg.item]
            if it.runs is not None:
                for layer in range(seg.l0, seg.l1):
                    for j in (0, 1):
                        for s0, d0, n in it.runs:
                            x0 = s0 if sender else d0
                            msgs.append(cache[layer, j, x0:x0 + n])
                continue
            size = it.staged_bytes(seg.l1 - seg.l0, self.plane_block_bytes)
            buf = slot[off:off + size].view(cache.dtype).view((seg.l1 - seg.l0, 2, it.n) + tuple(cache.shape[3:]))
            off += size
            if sender:
                copy_blocks(buf, None, cache[seg.l0:seg.l1], ids[seg.item])
            else:
                scatters.append(partial(copy_blocks, cache[seg.l0:seg.l1], ids[seg.item], buf, None))
            msgs.append(buf)
        return msgs, scatters

    # -- prefill side -----------------------------------------------------------------------------------
    def _payload_issue(self, pair: Pair, b, launch: Launch, ready) -> None:
        link = pair.payload
        with self._on_stream(link.stream):
            if ready is not None:
                link.stream.wait_event(ready)  # the layers this launch carries are computed
            if b.payload is None:
                b.payload = _BundleIO(self._ids(b, "src"))
            msgs, _ = self._messages(link, b, launch, "src", b.payload.ids)
            works = self._p2p(link, msgs, send=True)
            if link.stream is not None and any(b.items[s.item].runs is None for s in launch):
                link.slot_work[link.last_slot] = works[0]
            b.payload.works += works
            b.payload.keep.append(msgs)

    def _payload_seal(self, pair: Pair, b):
        link, io = pair.payload, b.payload or _BundleIO({})
        if link.stream is None:
            return HostCompletion([(io.works, [])], io.keep), -1
        with self._on_stream(link.stream):
            for w in io.works:
                w.wait()
            ev = torch.cuda.Event(blocking=True)
            ev.record(link.stream)
        return EventCompletion(ev, io.works, io.keep), -1

    # -- decode side ------------------------------------------------------------------------------------
    def _payload_post(self, pair: Pair, b):
        link = pair.payload
        works_all, keep, steps, err = [], [], [], None
        with self._on_stream(link.stream):
            try:
                ids = self._ids(b, "dst")
                pending = None
                for launch in b.launches:
                    msgs, scatters = self._messages(link, b, launch, "dst", ids)
                    works = self._p2p(link, msgs, send=False)
                    works_all += works
                    keep.append((msgs, ids))
                    if link.stream is None:
                        steps.append((works, scatters))
                        continue
                    if pending is not None:
                        self._land(*pending)
                    pending = (works, scatters)
                if pending is not None:
                    self._land(*pending)
            except Exception as e:  # noqa: BLE001 - the completion still covers what was posted
                err = f"{type(e).__name__}: {e}"
            if link.stream is None:
                return HostCompletion(steps, keep), err
            ev = torch.cuda.Event(blocking=True)
            ev.record(link.stream)
        return EventCompletion(ev, works_all, keep), err

    @staticmethod
    def _land(works, scatters) -> None:
        for w in works:
            w.wait()  # the pair stream (current) waits for the receive
        for fn in scatters:
            fn()
