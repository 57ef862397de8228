"""Staging memory of the torch_dist payload: one ring of slots per pair and side, within one budget
per worker.

A `StagingRing` is allocated once, when its pair forms (and warmed with it), and reused round-robin by
every launch of every bundle on that pair: launch k of the pair gathers into (sender) or receives into
(receiver) slot k mod `slots`. Each slot holds one launch, `slot_bytes` = TransportSpec.staging_bytes =
PlanSpec.chunk_bytes (plan.py keeps every launch within it). Reuse rule: a slot is written again only
after its last reader is done: on the sender the send that read it (`last`), on the receiver the
scatter out of it; torch_dist.py says how each backend orders that (streams on CUDA, the pair's waiter
thread on CPU). Two slots are enough for a pipeline: gather k+1 (HBM, ~10x the wire) runs while
launch k is on the wire, and the receiver scatters k while k+1 arrives.

Why per pair and not one pool per worker: a slot shared by two pairs would make one pair's receive
wait for another pair's scatter; with two prefill and two decode workers sharing slots crosswise that
waiting can close a cycle across processes and hang every pair in it. Per pair, a pair waits only for
itself.

Memory: `slots * slot_bytes` per pair and side, allocated on the cache's device (CUDA) or in host
memory (gloo). A worker's rings together never pass TransportSpec.staging_cap_bytes
(`StagingBudget`): a pair whose ring would is refused when it forms, with an error naming the knobs.
On a GPU this memory comes out of the headroom the KV pool sizing leaves (cluster/kv/kv_cache.py:
kv_pool_blocks keeps at least 1 GiB plus (1 - kv_memory_fraction) of the device free): with the
defaults (2 x 32 MiB per pair) a decode worker with 8 prefill peers holds 512 MiB. `metrics()` of the
transport reports what is reserved.
"""

from __future__ import annotations

import threading

import torch

from cluster.transport.plan import Launch


class StagingBudget:
    """A worker's staging memory: reserved ring by ring, given back when a pair goes; never past cap."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.reserved = 0
        self.rings = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, peer: str) -> None:
        with self._lock:
            if self.reserved + nbytes > self.cap_bytes:
                raise RuntimeError(
                    f"the staging ring for the pair with {peer} ({nbytes >> 20} MiB) would take this worker's "
                    f"KV staging past staging_cap_bytes={self.cap_bytes >> 20} MiB ({self.rings} rings, "
                    f"{self.reserved >> 20} MiB reserved): raise staging_cap_bytes or lower staging_bytes / staging_slots")
            self.reserved += nbytes
            self.rings += 1

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes
            self.rings -= 1


class StagingRing:
    """One pair's staging slots on one side (uint8 buffers of `slot_bytes`)."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device):
        self.bufs = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.last: list = [None] * slots  # sender: the torch.distributed work of the send that last read each slot
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)

    def take(self) -> int:
        """The slot of the pair's next launch (round-robin over all its bundles)."""
        k = self._next
        self._next = (k + 1) % len(self.bufs)
        return k

    def slot(self, k: int, launch: Launch, nbytes: int, cache: torch.Tensor,
             heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the message: the slot's first `nbytes` as uint8, the same bytes as the launch's
        [layers, 2, blocks, block_size, heads, head_dim] staging layout in the cache's dtype; heads: the
        launch's link's (tensor parallelism), else all of the cache's)."""
        raw = self.bufs[k][:nbytes]
        h = cache.shape[4] if heads is None else heads
        return raw, raw.view(cache.dtype).view((launch.layers, 2, launch.blocks, cache.shape[3], h, cache.shape[5]))
