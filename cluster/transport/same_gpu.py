"""KV transfer when prefill and decode share one device: the prefill writes the decode worker's blocks.

The decode worker exports its KV pool once: on CUDA as an IPC handle (`reduce_tensor`), published in
the store as msgpack (no pickle); on CPU ("local", tests) by registering the tensor in this process.
The prefill worker maps the pool once per decode peer, then per transfer:
  claim header (control.py) -> copy its blocks into the reserved ones on its own copy stream -> sync
  that stream -> set "a". The decode side saw the claim, waits for "a" and reports the arrival.
Ownership: the claim is atomic against the decode side's cancel, so a write only ever goes into blocks
still reserved for this transfer; once claimed, the decode side keeps them until "a" or until
transfer_timeout_s (then the peer is marked dead: see the report's hazard note on zombie writers).
"""

from __future__ import annotations

import os

import msgpack
import torch

from cluster.messages import Reservation
from cluster.transport.control import StoreCoordinatedTransport

_LOCAL_POOLS: dict[tuple[str, str], torch.Tensor] = {}  # (namespace, decode worker id) -> its KV cache
_MAX_RUNS = 8  # above this many contiguous runs, gather + one index_copy_ beats many strided copies


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src0, dst0, length) runs where both block lists advance by one."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def copy_blocks(dst_cache: torch.Tensor, dst_ids: list[int], src_cache: torch.Tensor, src_ids: list[int]) -> None:
    """dst_cache[:, :, dst_ids] = src_cache[:, :, src_ids], in one pass over the bytes where possible:
    a contiguous run is one strided copy_ (2*L chunks of run*block bytes); gather+scatter would read
    and write everything twice."""
    runs = block_runs(src_ids, dst_ids)
    # NOTE: a strided copy is not vectorised; moving 8-byte words instead of bf16 elements cuts its
    # index arithmetic 4x (head_dim * itemsize is a multiple of 8 for every model we serve).
    if (dst_cache.shape[-1] * dst_cache.element_size()) % 8 == 0 and dst_cache.dtype == src_cache.dtype:
        dst_cache, src_cache = dst_cache.view(torch.int64), src_cache.view(torch.int64)
    if len(runs) <= _MAX_RUNS:
        for s0, d0, n in runs:
            dst_cache[:, :, d0:d0 + n].copy_(src_cache[:, :, s0:s0 + n], non_blocking=True)
    else:
        dev = dst_cache.device
        dst_cache.index_copy_(2, torch.tensor(dst_ids, device=dev),
                              src_cache.index_select(2, torch.tensor(src_ids, device=src_cache.device)))


def export_handle(kv_cache: torch.Tensor, namespace: str, worker_id: str) -> bytes:
    if kv_cache.device.type != "cuda":
        _LOCAL_POOLS[(namespace, worker_id)] = kv_cache
        return msgpack.packb({"kind": "local", "pid": os.getpid()})
    from torch.multiprocessing.reductions import reduce_tensor

    _, a = reduce_tensor(kv_cache)
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, requires_grad,
     ref_handle, ref_offset, event_handle, event_sync) = a
    return msgpack.packb({"kind": "cuda_ipc", "size": list(size), "stride": list(stride), "offset": offset,
                          "dtype": str(dtype).removeprefix("torch."), "device": device, "handle": handle,
                          "storage_bytes": storage_bytes, "storage_offset": storage_offset,
                          "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
                          "event_sync": event_sync})


def import_handle(raw: bytes, namespace: str, worker_id: str, local_device: torch.device) -> torch.Tensor:
    d = msgpack.unpackb(raw)
    if d["kind"] == "local":
        if d["pid"] != os.getpid():
            raise RuntimeError(f"decode worker {worker_id}'s CPU pool lives in another process; the local "
                               "same-device path needs both workers in one process (use torch_dist)")
        return _LOCAL_POOLS[(namespace, worker_id)]
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if local_device.type == "cuda" and local_device.index not in (None, d["device"]):
        raise RuntimeError(f"decode pool is on cuda:{d['device']}, this worker on {local_device}: not the same GPU")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"],
                               torch.UntypedStorage, getattr(torch, d["dtype"]), d["device"], d["handle"],
                               d["storage_bytes"], d["storage_offset"], False, d["ref_handle"], d["ref_offset"],
                               d["event_handle"], d["event_sync"])


class SameGPUTransport(StoreCoordinatedTransport):
    def __init__(self, spec, kv_cache, worker_id, role, store_factory):
        super().__init__(spec, kv_cache, worker_id, role, store_factory)
        self._pools: dict[str, torch.Tensor] = {}
        cuda = kv_cache.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        if role == "decode":
            self._store().set(f"{self.ns}/ipc/{worker_id}", export_handle(kv_cache, self.ns, worker_id))

    def _pool(self, store, peer: str, deadline: float) -> torch.Tensor:
        pool = self._pools.get(peer)
        if pool is None:
            raw = self._wait_key(store, f"{self.ns}/ipc/{peer}", peer, deadline, "the KV pool's IPC handle")
            if raw is None:
                raise TimeoutError(f"decode worker {peer} never published its KV pool")
            pool = import_handle(raw, self.ns, peer, self.kv_cache.device)
            if pool.shape[:2] != self.kv_cache.shape[:2] or pool.shape[3:] != self.kv_cache.shape[3:] or pool.dtype != self.kv_cache.dtype:
                raise RuntimeError(f"KV layout mismatch: decode pool {tuple(pool.shape)} {pool.dtype}, "
                                   f"prefill cache {tuple(self.kv_cache.shape)} {self.kv_cache.dtype}")
            self._pools[peer] = pool
        return pool

    def map_pool(self, decode_worker_id: str, timeout_s: float = 30.0) -> None:
        """Optional warm-up: map a decode worker's pool before the first transfer."""
        import time

        self._pool(self._store(), decode_worker_id, time.monotonic() + timeout_s)

    def _push(self, store, reservation: Reservation, src_block_ids: list[int], deadline: float) -> int:
        peer = reservation.decode_worker_id
        pool = self._pool(store, peer, deadline)
        dst = list(reservation.block_ids[:len(src_block_ids)])
        if self._copy_stream is not None:
            # NOTE: the prefill loop synchronised (it read the sampled token) before handing off, so the
            # KV is complete; a side stream keeps this copy off the next batch's compute.
            with torch.cuda.stream(self._copy_stream):
                copy_blocks(pool, dst, self.kv_cache, src_block_ids)
            self._copy_stream.synchronize()  # landed in the decode pool before "a"
        else:
            copy_blocks(pool, dst, self.kv_cache, src_block_ids)
        store.set(self._key(self.worker_id, peer, reservation.transfer_seq, "a"), b"1")
        return len(src_block_ids) * self.bytes_per_block

    def _pull(self, store, peer: str, res: Reservation, nblocks: int, deadline: float) -> int:
        akey = self._key(peer, self.worker_id, res.transfer_seq, "a")
        landed = self._wait_key(store, akey, peer, deadline, f"landing of transfer {res.transfer_seq}")
        if landed is None:
            raise TimeoutError(f"prefill worker {peer} claimed transfer {res.transfer_seq} but did not finish "
                               f"writing within transfer_timeout_s={self.spec.transfer_timeout_s}")
        store.delete_key(akey)
        return nblocks * self.bytes_per_block
