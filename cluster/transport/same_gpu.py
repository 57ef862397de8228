"""KV payload when prefill and decode share one device: the prefill writes the decode worker's blocks.

The decode worker exports its KV pool once: on CUDA as an IPC handle (`reduce_tensor`), published with
its control endpoint (msgpack via msgspec, no pickle); on CPU ("local", tests) by registering the tensor in this
process. The prefill worker maps the pool when the pair connects, creates a ring of interprocess CUDA
events and sends their handles in the hello; warming the pair runs the copy kernel once (into the NULL
block, which holds garbage by design), so nothing is compiled during a transfer.

Per launch (plan.py: the whole bundle, or one layer of it when layer-wise) the prefill enqueues one
fused gather/scatter kernel for every item of the bundle at once (block_copy.py: the bundle's source
and reserved block ids, concatenated) on the pair's stream, after the compute-stream event of the
layers it carries; there is no receive to post and nothing is staged. The
doorbell: after the last launch it records the next ring event on the pair stream and the commit names
it; the decode side queries that event (never the store). A ring slot is recorded again only for a later
bundle on the same stream, so a stale query can only report "not yet", never a false "done".
Ownership: the claim is atomic against the decode side's cancel, so a write only ever goes into blocks
still reserved for this transfer. Hazard: a prefill presumed dead (silent past peer_timeout_s) while its
process lives on could still write a claimed transfer's blocks after the decode side gave them back.
"""

from __future__ import annotations

import os

import msgspec
import torch

from cluster.transport.block_copy import copy_blocks
from cluster.transport.completion import DeferredCompletion, EventCompletion, ReadyCompletion
from cluster.transport.pair import Pair
from cluster.transport.payload import KVPayload, PayloadEnd
from cluster.transport.plan import Launch, bundle_blocks, plan_copies, plan_item

_LOCAL_POOLS: dict[tuple[str, str], torch.Tensor] = {}  # (namespace, decode worker id) -> its KV cache
_EVENTS = 64  # doorbell events per pair


def export_handle(kv_cache: torch.Tensor, namespace: str, worker_id: str) -> bytes:
    if kv_cache.device.type != "cuda":
        _LOCAL_POOLS[(namespace, worker_id)] = kv_cache
        return msgspec.msgpack.encode({"kind": "local", "pid": os.getpid()})
    from torch.multiprocessing.reductions import reduce_tensor

    _, a = reduce_tensor(kv_cache)
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, requires_grad,
     ref_handle, ref_offset, event_handle, event_sync) = a
    return msgspec.msgpack.encode({"kind": "cuda_ipc", "size": list(size), "stride": list(stride), "offset": offset,
                          "dtype": str(dtype).removeprefix("torch."), "device": device, "handle": handle,
                          "storage_bytes": storage_bytes, "storage_offset": storage_offset,
                          "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
                          "event_sync": event_sync})


def import_handle(raw: bytes, namespace: str, worker_id: str, local_device: torch.device) -> torch.Tensor:
    d = msgspec.msgpack.decode(raw)
    if d["kind"] == "local":
        if d["pid"] != os.getpid():
            raise RuntimeError(f"decode worker {worker_id}'s CPU pool lives in another process; the local "
                               "same-device path needs both workers in one process (use torch_dist)")
        return _LOCAL_POOLS[(namespace, worker_id)]
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if local_device.type != "cuda" or local_device.index not in (None, d["device"]):
        raise RuntimeError(f"decode pool is on cuda:{d['device']}, this worker on {local_device}: not the same GPU")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"],
                               torch.UntypedStorage, getattr(torch, d["dtype"]), d["device"], d["handle"],
                               d["storage_bytes"], d["storage_offset"], False, d["ref_handle"], d["ref_offset"],
                               d["event_handle"], d["event_sync"])


class _Pool:
    """Prefill side of one pair: the decode pool mapped here, our stream, the doorbell ring."""

    def __init__(self, pool: torch.Tensor, stream, events):
        self.pool, self.stream, self.events, self.next_event = pool, stream, events, 0


class SameGPUPayload(KVPayload):
    """The same-device payload: copies into the decode worker's mapped pool (the module docstring)."""

    def __init__(self, end: PayloadEnd):
        self.kv_cache, self.ns, self.worker_id = end.kv_cache, end.spec.namespace, end.worker_id

    def info(self) -> dict:
        return {"ipc": export_handle(self.kv_cache, self.ns, self.worker_id)}

    def plan_kind(self) -> tuple[str, int]:
        return "same_gpu", 0

    def plan(self, pair, srcs, dsts, layerwise):
        items = [plan_item(s, d) for s, d in zip(srcs, dsts)]
        return items, plan_copies(pair.spec, sum(it.n for it in items), layerwise)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int32)
        if self.kv_cache.is_cuda:  # NOTE: pinned + non_blocking on the pair stream: no host sync
            t = t.pin_memory().to(self.kv_cache.device, non_blocking=True)
        return t

    # -- prefill side -----------------------------------------------------------------------------------
    def prepare(self, pair: Pair, info: dict) -> list[bytes]:
        pool = import_handle(info["ipc"], self.ns, pair.peer, self.kv_cache.device)
        if tuple(pool.shape[:2]) + tuple(pool.shape[3:]) != tuple(self.kv_cache.shape[:2]) + tuple(self.kv_cache.shape[3:]) \
                or pool.dtype != self.kv_cache.dtype:
            raise RuntimeError(f"KV layout mismatch: decode pool {tuple(pool.shape)} {pool.dtype}, "
                               f"prefill cache {tuple(self.kv_cache.shape)} {self.kv_cache.dtype}")
        if not self.kv_cache.is_cuda:
            pair.payload = _Pool(pool, None, [])
            return []
        with torch.cuda.device(self.kv_cache.device):
            events = [torch.cuda.Event(blocking=True, interprocess=True) for _ in range(_EVENTS)]
            pair.payload = _Pool(pool, torch.cuda.Stream(self.kv_cache.device), events)
            return [bytes(e.ipc_handle()) for e in events]

    def warm(self, pair: Pair) -> None:
        p = pair.payload
        with self._on_stream(p.stream):
            zero = self._ids([0])
            copy_blocks(p.pool, zero, self.kv_cache, zero)  # NULL block -> NULL block: compiles the kernel
        if p.stream is not None:
            p.stream.synchronize()

    def issue(self, pair: Pair, b, launch: Launch, ready) -> None:
        p = pair.payload
        with self._on_stream(p.stream):
            if ready is not None:
                p.stream.wait_event(ready)  # the layers this launch carries are computed
            if b.payload is None:
                b.payload = (self._ids(bundle_blocks(b.items, "src")), self._ids(bundle_blocks(b.items, "dst")))
            src_ids, dst_ids = b.payload
            l0, l1, b0, b1 = launch.l0, launch.l1, launch.b0, launch.b1
            copy_blocks(p.pool[l0:l1], dst_ids[b0:b1], self.kv_cache[l0:l1], src_ids[b0:b1])

    def seal(self, pair: Pair, b):
        p = pair.payload
        if p.stream is None:
            return ReadyCompletion(), -1  # the copies ran on this thread
        k = p.next_event
        p.next_event = (k + 1) % len(p.events)
        ev = p.events[k]
        ev.record(p.stream)
        return EventCompletion(ev, keep=b.payload), k

    def abort(self, pair: Pair) -> None:
        """Nothing to tear down: the copies in flight finish on their own (or died with the prefill)."""

    # -- decode side ------------------------------------------------------------------------------------
    def accept(self, pair: Pair, hello) -> None:
        dev = self.kv_cache.device
        pair.payload = [torch.cuda.Event.from_ipc_handle(dev, h) for h in hello.events]

    def post(self, pair: Pair, b):
        return DeferredCompletion(), None  # nothing to post: the commit names the event to query

    def commit(self, pair: Pair, b, msg) -> None:
        b.completion.bind(EventCompletion(pair.payload[msg.event]) if msg.event >= 0 else ReadyCompletion())
