"""KV blocks of the decode worker's requests. Plain Python over `cluster.block_allocator`, no torch.

Two hazards it owns, both about *when* a block may go back to the pool:
- a step in flight on the GPU may still write a row's K/V into a block: blocks of a request that left
  the batch are freed only after the last step that included it completed (`free_after_step`);
- a KV transfer may still land in reserved blocks: an aborted reservation is freed only once the
  transport reports that transfer finished or failed (`hold_for_transfer` / `release_transfer`).
"""

from __future__ import annotations

from cluster.block_allocator import BlockAllocator


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self._after_step: list[tuple[int, list[int]]] = []  # (step, blocks): free once step completed
        self._held_for_transfer: dict[str, list[int]] = {}  # request_id -> blocks a transfer may land in

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def num_pending_free(self) -> int:
        """Blocks no request owns any more but that a step or a transfer may still write."""
        return sum(len(b) for _, b in self._after_step) + sum(len(b) for b in self._held_for_transfer.values())

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    # -- allocation -------------------------------------------------------------------------------
    def allocate_for_tokens(self, num_tokens: int) -> list[int] | None:
        n = self.blocks_for_tokens(num_tokens)
        return self.allocator.allocate(n) if self.allocator.can_allocate(n) else None

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a table needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Appends blocks so the table holds `num_tokens`; False (and no change) if the pool is short."""
        n = self.blocks_needed(block_table, num_tokens)
        if n == 0:
            return True
        if not self.allocator.can_allocate(n):
            return False
        block_table.extend(self.allocator.allocate(n))
        return True

    # -- freeing ----------------------------------------------------------------------------------
    def free_now(self, blocks: list[int]) -> None:
        if blocks:
            self.allocator.free(blocks)

    def free_after_step(self, blocks: list[int], step: int, completed_step: int) -> None:
        """Frees `blocks` once step `step` has completed on the device (now, if it already has)."""
        if not blocks:
            return
        if step <= completed_step:
            self.allocator.free(blocks)
        else:
            self._after_step.append((step, list(blocks)))

    def step_completed(self, step: int) -> int:
        """The device finished every step up to `step`: frees what waited for it. Returns the count."""
        keep, freed = [], 0
        for s, blocks in self._after_step:
            if s <= step:
                self.allocator.free(blocks)
                freed += len(blocks)
            else:
                keep.append((s, blocks))
        self._after_step = keep
        return freed

    def hold_for_transfer(self, request_id: str, blocks: list[int]) -> None:
        """An aborted reservation whose transfer may still land: keep its blocks out of the pool."""
        self._held_for_transfer[request_id] = list(blocks)

    def release_transfer(self, request_id: str) -> bool:
        """The transport reported the transfer into `request_id`'s blocks done: they may be reused."""
        blocks = self._held_for_transfer.pop(request_id, None)
        if blocks is None:
            return False
        self.allocator.free(blocks)
        return True

    def is_held_for_transfer(self, request_id: str) -> bool:
        return request_id in self._held_for_transfer
