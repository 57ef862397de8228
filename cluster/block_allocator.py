"""Hands out KV-cache block ids. Plain Python, no torch: it is tested on CPU and shared by the engine,
the decode worker's block manager and the prefill worker.
"""

from __future__ import annotations

from collections import deque

from cluster.errors import CapacityError
from cluster.kv_cache import NULL_BLOCK


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO reuse: a freed block is reused as late as possible, which makes use-after-free bugs
        # (a late write into a block already given to another request) easier to catch in tests.
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"double free or foreign block {b}")
            self._used.remove(b)
            self._free.append(b)

    def usage(self) -> float:
        return len(self._used) / self.capacity
