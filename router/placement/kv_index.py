"""KVBlockIndex: which worker holds which cached KV block, as the workers report it.

Each worker's block pool keeps a change feed of the addresses it caches (cluster.kv.block_pool); the
router polls it with the worker's stats (`kv_events(epoch, seq)`) and applies the net changes here.
Addresses are hash chains (cluster.kv.block_hash), so a block's address names its whole prefix: a flat map
address -> workers answers "how many leading blocks of this prompt does worker W hold" by walking the
prompt's addresses, which is what Dynamo's radix tree answers. The index is approximate (it lags the
workers by a poll, and a worker may evict a block right after reporting it): placement uses it to rank
workers, never to decide what a worker has; the worker's own pool decides that at reservation time.

Plain Python, no torch; tested on CPU.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from cluster.kv.block_hash import BlockHash, BlockHasher
from cluster.wire.messages import KVCacheEvents


class KVBlockIndex:
    def __init__(self) -> None:
        self._workers_of: dict[BlockHash, set[str]] = {}
        self._blocks_of: dict[str, set[BlockHash]] = {}
        self._position: dict[str, tuple[str | None, int]] = {}
        self._hasher: BlockHasher | None = None  # the workers' address space (salt, block size)
        self._last: tuple = ((), None, ())  # (prompt, hasher, its hashes): the last prompt hashed

    # -- feeding ----------------------------------------------------------------------------------
    def position(self, worker_id: str) -> tuple[str | None, int]:
        """(epoch, seq) to ask the worker's change feed from."""
        return self._position.get(worker_id, (None, 0))

    def apply(self, ev: KVCacheEvents) -> None:
        w, ch = ev.worker_id, ev.changes
        if self._hasher is None or (self._hasher.salt, self._hasher.block_size) != (ev.salt, ev.block_size):
            if self._hasher is not None:
                # Workers that address blocks differently share nothing: keep only this one's view.
                for other in list(self._blocks_of):
                    self.drop(other)
            self._hasher = BlockHasher(ev.block_size, ev.salt)
        mine = self._blocks_of.setdefault(w, set())
        if ch.reset:
            for h in mine - set(ch.stored):
                self._remove(w, h)
        for h in ch.removed:
            if h in mine:
                self._remove(w, h)
        for h in ch.stored:
            if h not in mine:
                mine.add(h)
                self._workers_of.setdefault(h, set()).add(w)
        self._position[w] = (ch.epoch, ch.seq)

    def drop(self, worker_id: str) -> None:
        """Forgets a worker (dead, or its address space changed); it is re-read from scratch."""
        for h in self._blocks_of.pop(worker_id, set()):
            self._remove(worker_id, h, own=False)
        self._position.pop(worker_id, None)

    def _remove(self, w: str, h: BlockHash, own: bool = True) -> None:
        if own:
            self._blocks_of[w].discard(h)
        holders = self._workers_of.get(h)
        if holders is not None:
            holders.discard(w)
            if not holders:
                del self._workers_of[h]

    # -- queries ----------------------------------------------------------------------------------
    @property
    def block_size(self) -> int | None:
        return self._hasher.block_size if self._hasher else None

    def hashes(self, token_ids: Sequence[int]) -> tuple[BlockHash, ...]:
        """The addresses of the prompt's blocks that a hit may cover (never the last token's block:
        the cache-hit rule of cluster.kv.block_pool); empty before any worker reported.

        One placement asks for one prompt's up to four times (the walk for each indexed role, each
        prefix-aware policy's ranking; ~0.1 ms each for 2048 tokens on a CPU host, on the router's
        loop): the last prompt's are kept, for the same tuple (immutable: the same object is the same
        ids) in the same address space."""
        if self._hasher is None or not token_ids:
            return ()
        prompt, hasher, hashes = self._last
        if prompt is token_ids and hasher is self._hasher:
            return hashes
        hashes = tuple(self._hasher.extend([], token_ids, (len(token_ids) - 1) // self._hasher.block_size))
        if isinstance(token_ids, tuple):
            self._last = (token_ids, self._hasher, hashes)
        return hashes

    def overlap(self, hashes: Sequence[BlockHash], worker_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (as last reported)."""
        alive = set(worker_ids)
        out = dict.fromkeys(alive, 0)
        for i, h in enumerate(hashes):
            alive &= self._workers_of.get(h, set())
            if not alive:
                break
            for w in alive:
                out[w] = i + 1
        return out

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks_of.get(worker_id, ()))
