"""PrefixCachingBlockPool: hands out KV-cache block ids and keeps freed full blocks as a prefix cache.
Plain Python, no torch: tested on CPU and shared by the engine, the prefill worker and the decode
worker's block manager.

Every usable block is in exactly one state:
- *free*: no content worth keeping; handed out first, oldest freed first (FIFO reuse makes a late
  write into a reused block show up in tests rather than hide).
- *in use*: ref count > 0 (one per block table holding it). Never handed out again, never evicted:
  a cached block shared by several requests is only ever read by them (a request writes only past its
  cached prefix), so it can't be overwritten while anyone uses it.
- *cached and free*: ref count 0 but holding a full block whose address (cluster.kv.block_hash) is
  registered; kept in LRU order and evicted (address dropped, block reused) only when no free block
  is left. A request that finds it by address takes it back into use (ref count 1).

A block is registered only once its K/V are computed or have landed (`cache_full_blocks`); reserved
blocks that a transfer may still write are never found by address.

With caching off the pool is a plain allocator: nothing is registered, every freed block is free.

Change feed: with `event_log_size`, every address registered or evicted is logged, and
`events_since(epoch, seq)` gives the net change of the cached set since a reader's last look (or the
whole set, when the reader's position is from another pool or older than what the log keeps). The
router indexes the workers' caches from it (router.placement.kv_index), as Dynamo's KV router does from its
workers' block events.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from cluster.kv.block_hash import BlockHash, BlockHasher
from cluster.errors import CapacityError
from cluster.kv.kv_blocks import NULL_BLOCK, blocks_for_tokens


# Events a worker's pool keeps for the router's index: enough for several seconds of churn between two
# polls (one event per block registered or evicted); a router further behind gets the whole set.
WORKER_EVENT_LOG_SIZE = 1 << 16


@dataclass
class PrefixCacheStats:
    """Counters in vLLM's terms: prompt tokens looked up in the cache, and those found there."""

    queries: int = 0  # tokens
    hits: int = 0  # tokens
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class CacheChanges:
    """The net change of a pool's cached addresses after event `since` up to event `seq`."""

    epoch: str  # names this pool instance; positions are only comparable within one epoch
    seq: int
    reset: bool  # True: `stored` is the whole cached set and the reader drops what it had
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...]


class PrefixCachingBlockPool:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"", enable_caching: bool = True,
                 event_log_size: int = 0):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = BlockHasher(block_size, salt)
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # address -> the block holding it
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; least recently used first
        # Change feed: (address, stored?) of events _log_base + 1 ... _log_base + len(_log).
        self.epoch = os.urandom(8).hex()
        self._log_size = event_log_size
        self._log: list[tuple[BlockHash, bool]] = []
        self._log_base = 0

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now: free ones plus cached ones nobody uses (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered address (in use or evictable)."""
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used / self.capacity

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- plain allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks with no content, ref count 1: free ones first, then the least recently used
        cached ones (their addresses are dropped)."""
        if n > self.num_free:
            raise CapacityError(f"need {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of[b]]
                self._log_event(self._hash_of[b], False)
                self._hash_of[b] = None
                self.stats.evicted_blocks += 1
            self._ref[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each block. A block nobody holds any more becomes free, or cached and
        free if it has an address. Tail blocks go first into the LRU order, so a sequence's last blocks
        are evicted before its first ones (a prefix is only useful from its start)."""
        for b in reversed(blocks):
            if not 0 < b < self.num_blocks or self._ref[b] == 0:
                raise ValueError(f"double free or foreign block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- prefix caching ---------------------------------------------------------------------------
    def allocate_prompt(self, token_ids: Sequence[int], num_slots: int, hashes: list[BlockHash],
                        count: bool = True, lookup: bool = True) -> tuple[list[int], int] | None:
        """A block table for `num_slots` tokens whose first len(token_ids) are `token_ids`: the longest
        cached prefix of them (ref-counted), then fresh blocks. Returns (table, cached tokens), or None
        with nothing taken when the fresh blocks don't fit.

        THE cache-hit rule, for every worker: only whole blocks, and never the last prompt token (at
        least one token is computed, so the prefill yields the logits of the first sampled token).
        `hashes` is the caller's list of the sequence's block addresses, extended here as needed.
        `count`: the lookup counts in the hit-rate statistics (not for a preempted sequence's
        recompute, whose hits are its own earlier blocks). `lookup=False`: no hit, the whole prompt is
        computed (a request that asks for prompt logprobs: SamplingParams.reads_prefix_cache)."""
        hit: list[int] = []
        if self.enable_caching and lookup and token_ids:
            max_hit = (len(token_ids) - 1) // self.block_size
            self.hasher.extend(hashes, token_ids, max_hit)
            for h in hashes[:max_hit]:
                b = self._cached.get(h)
                if b is None:
                    break
                hit.append(b)
        fresh = self.blocks_for_tokens(num_slots) - len(hit)
        reclaimed = sum(1 for b in hit if self._ref[b] == 0)  # evictable now, in use once taken
        if fresh > self.num_free - reclaimed:
            return None
        for b in hit:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        table = hit + self.allocate(fresh)
        if count:
            self.stats.queries += len(token_ids)
            self.stats.hits += len(hit) * self.block_size
        return table, len(hit) * self.block_size

    def cache_full_blocks(self, table: Sequence[int], token_ids: Sequence[int], hashes: list[BlockHash],
                          num_computed_before: int, num_computed: int) -> None:
        """The K/V of tokens [num_computed_before, num_computed) of the sequence owning `table` are now
        complete: registers the blocks that became full. A block whose address another block already
        holds (the same prefix computed twice at once) stays anonymous and is simply freed later."""
        lo, hi = num_computed_before // self.block_size, num_computed // self.block_size
        if not self.enable_caching or hi <= lo:
            return
        self.hasher.extend(hashes, token_ids, hi)
        for i in range(lo, hi):
            b, h = table[i], hashes[i]
            if self._hash_of[b] is None and h not in self._cached:
                self._hash_of[b] = h
                self._cached[h] = b
                self._log_event(h, True)

    def is_cached(self, block: int) -> bool:
        return self._hash_of[block] is not None

    # -- change feed ------------------------------------------------------------------------------
    def _log_event(self, h: BlockHash, stored: bool) -> None:
        if not self._log_size:
            return
        self._log.append((h, stored))
        if len(self._log) > 2 * self._log_size:  # drop the older half (amortised O(1) per event)
            drop = len(self._log) - self._log_size
            del self._log[:drop]
            self._log_base += drop

    @property
    def event_seq(self) -> int:
        return self._log_base + len(self._log)

    def events_since(self, epoch: str | None, seq: int) -> CacheChanges:
        """What changed in the cached set after event `seq` of pool `epoch` (see CacheChanges)."""
        head = self.event_seq
        if not self._log_size or epoch != self.epoch or not self._log_base <= seq <= head:
            return CacheChanges(self.epoch, head, True, tuple(self._cached), ())
        net: dict[BlockHash, bool] = {}
        for h, stored in self._log[seq - self._log_base:]:
            net.pop(h, None)  # keep the order of the last change
            net[h] = stored
        return CacheChanges(self.epoch, head, False, tuple(h for h, s in net.items() if s),
                            tuple(h for h, s in net.items() if not s))

    # -- accounting -------------------------------------------------------------------------------
    def stats_extra(self) -> dict[str, int]:
        """The prefix-cache counters, as a worker reports them in `WorkerStats.extra`."""
        st = self.stats
        return {"prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits,
                "prefix_cache_evicted_blocks": st.evicted_blocks, "prefix_cache_blocks": self.num_cached}

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def check(self, held: Sequence[Sequence[int]] | None = None) -> None:
        """Raises AssertionError unless every block is in exactly one state and the address index
        matches the blocks. With `held` (every block list that holds references: block tables,
        deferred frees), each block's ref count must equal the number of times it appears there:
        no leaked block, no block owned twice without its count saying so."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & evictable, "a block is both free and cached-free"
        assert NULL_BLOCK not in free | evictable and self._ref[NULL_BLOCK] == 0, "the null block was handed out"
        for b in range(1, self.num_blocks):
            r, h = self._ref[b], self._hash_of[b]
            assert r >= 0, f"block {b}: negative ref count"
            if r == 0:
                assert (b in free) != (b in evictable), f"block {b}: unreferenced but neither free nor cached-free"
                assert (h is not None) == (b in evictable), f"block {b}: cached-free iff it has an address"
            else:
                assert b not in free and b not in evictable, f"block {b}: in use and free"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}: address not indexed"
        assert len(self._cached) == sum(h is not None for h in self._hash_of), "index holds a stale address"
        if held is not None:
            counts = [0] * self.num_blocks
            for blocks in held:
                for b in blocks:
                    counts[b] += 1
            bad = [(b, self._ref[b], counts[b]) for b in range(1, self.num_blocks) if self._ref[b] != counts[b]]
            assert not bad, f"(block, ref count, holders) that disagree: {bad[:8]}"
