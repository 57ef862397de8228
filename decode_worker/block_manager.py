"""KV blocks of the decode worker's requests. Plain Python over `cluster.kv.block_pool`, no torch.

With prefix caching, a block may be shared by several requests (ref-counted by the pool) and a freed
full block stays findable by its address until evicted: a local prefill takes its prompt's cached
prefix, and every block that fills (prompt blocks once computed or landed, decoded blocks once their
last step completed) is registered.

Two hazards it owns, both about *when* a block may go back to the pool:
- a step in flight on the GPU may still write a row's K/V into a block: blocks of a request that left
  the batch are freed only after the last step that included it completed (`free_after_step`);
- a KV transfer may still land in reserved blocks: an aborted reservation is freed only once the
  transport reports that transfer finished or failed (`hold_for_transfer` / `release_transfer`).
"""

from __future__ import annotations

from typing import Sequence as Seq

from cluster.kv.block_pool import WORKER_EVENT_LOG_SIZE, PrefixCacheStats, PrefixCachingBlockPool
from cluster.kv.kv_blocks import blocks_for_tokens, decode_held_tokens
from cluster.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"", enable_prefix_caching: bool = True):
        self.allocator = PrefixCachingBlockPool(num_blocks, block_size, salt, enable_prefix_caching,
                                                event_log_size=WORKER_EVENT_LOG_SIZE)
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

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.allocator.stats

    @property
    def num_cached_blocks(self) -> int:
        return self.allocator.num_cached

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    # -- allocation -------------------------------------------------------------------------------
    def allocate_prompt(self, seq: Sequence, count: bool = True) -> bool:
        """Blocks for everything the sequence has plus one decode slot, its cached prefix taken from
        the cache (seq.num_cached_tokens says how much); False, with nothing taken, if they don't fit.
        count=False for a preempted sequence's recompute (cluster.kv.block_pool.allocate_prompt)."""
        got = self.allocator.allocate_prompt(seq.all_token_ids, decode_held_tokens(seq.num_tokens), seq.block_hashes, count,
                                             lookup=seq.params.reads_prefix_cache)
        if got is None:
            return False
        seq.block_table, seq.num_cached_tokens = got
        return True

    def cache_computed(self, seq: Sequence, num_computed_before: int, num_computed: int) -> None:
        """The sequence's K/V up to `num_computed` tokens are complete on the device (in stream order
        before any later step or prefill): its blocks that became full are registered."""
        self.allocator.cache_full_blocks(seq.block_table, seq.all_token_ids, seq.block_hashes,
                                         num_computed_before, num_computed)

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

    def check(self, tables: Seq[Seq[int]]) -> None:
        """Block accounting (AssertionError if off): every reference the pool counts is one of the
        requests' `tables` or a deferred free here, and each block is in exactly one pool state."""
        self.allocator.check([*tables, *(b for _, b in self._after_step), *self._held_for_transfer.values()])
