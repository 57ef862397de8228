"""Content addresses of full KV blocks: a hash chain over token ids. Plain Python, no torch.

Block i of a sequence holds the K/V of tokens [i * block_size, (i + 1) * block_size), and those depend
on every token before them, so its address is `blake2b(address of block i-1 || its token ids)`; block
0 chains from the *salt*, which names what else the K/V depend on (the checkpoint, the KV dtype, the
block size). Equal addresses mean equal K/V, on any worker of the cluster that uses the same salt: the
prefill workers, the decode workers and the router (which indexes the decode workers' blocks) all
compute addresses with this one function. Only full blocks have an address; a partial last block is
never shared.

128-bit digests: a collision would silently serve another prompt's K/V, so the width is chosen so
that it never happens in practice (Python's `hash()` is neither wide enough nor stable across
processes).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Sequence

BlockHash = bytes  # 16 bytes

_DIGEST = 16
_VERSION = b"pdserve-prefix-cache-v1"


def prefix_cache_salt(model_dir: str | Path, kv_dtype: str, block_size: int) -> bytes:
    """The salt of a worker's block addresses: its checkpoint's config.json, KV dtype and block size.

    Workers of one cluster load the same checkpoint and so agree on it; a different model, KV dtype or
    block size gives addresses that never match (their K/V would differ)."""
    h = hashlib.blake2b(_VERSION, digest_size=_DIGEST)
    config = Path(model_dir) / "config.json"
    h.update(config.read_bytes() if config.is_file() else str(model_dir).encode())
    h.update(f"|{kv_dtype}|{block_size}".encode())
    return h.digest()


class BlockHasher:
    def __init__(self, block_size: int, salt: bytes):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.salt = salt
        self._fresh = hashlib.blake2b(digest_size=_DIGEST).copy  # a new hash of the addresses' kind
        # The last sequence hashed from its first block: its packed ids and their addresses (one tuple:
        # replaced whole, so a reader on another thread sees a consistent pair).
        self._last: tuple[bytes, tuple[BlockHash, ...]] = (b"", ())

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """Appends to `hashes` (the addresses of the first len(hashes) blocks of `token_ids`) those of
        blocks up to `num_blocks` (at most the full blocks of token_ids); returns `hashes`.

        A sequence's tokens only grow, so a caller keeps one list per sequence and extends it as
        blocks fill: every block is hashed once."""
        bs = self.block_size
        first, num_blocks = len(hashes), min(num_blocks, len(token_ids) // bs)
        if num_blocks <= first:
            return hashes
        # NOTE: the same bytes as one `<{bs}q` pack per block, packed in one call, and each block's
        # digest from a copy of a prepared blake2b: no tuple slice, argument unpacking or keyword
        # parsing per block. This runs on the first token's path (a prompt's lookup, before its pass).
        packed = struct.pack(f"<{(num_blocks - first) * bs}q", *token_ids[first * bs:num_blocks * bs])
        width, fresh = 8 * bs, self._fresh
        if first == 0:
            # Prompts that share a prefix (a system prompt, the turns of a conversation) follow each
            # other: the blocks whose ids equal the last sequence's have its addresses (an address is
            # a function of the ids up to its block's end), found by comparing bytes, not hashing.
            last_packed, last_hashes = self._last
            hashes.extend(last_hashes[:_common_blocks(packed, last_packed, width)])
        parent = hashes[-1] if hashes else self.salt
        for off in range((len(hashes) - first) * width, len(packed), width):
            h = fresh()
            h.update(parent)
            h.update(packed[off:off + width])
            parent = h.digest()
            hashes.append(parent)
        if first == 0:
            self._last = (packed, tuple(hashes))
        return hashes

    def hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The addresses of every full block of `token_ids`."""
        return self.extend([], token_ids, len(token_ids) // self.block_size)


def _common_blocks(a: bytes, b: bytes, width: int) -> int:
    """How many leading `width`-byte blocks a and b share (memcmp through startswith, by bisection)."""
    lo, hi = 0, min(len(a), len(b)) // width
    view = memoryview(b)
    if a.startswith(view[:hi * width]):
        return hi
    while hi - lo > 1:  # the first lo blocks are shared, the first hi are not
        mid = (lo + hi) // 2
        if a.startswith(view[:mid * width]):
            lo = mid
        else:
            hi = mid
    return lo
