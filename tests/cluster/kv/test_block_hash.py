"""cluster/kv/block_hash.py: the addresses are blake2b chains over `<{block_size}q`-packed ids, whatever
the steps a sequence's list is extended in."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from cluster.kv.block_hash import BlockHasher


def _reference(salt: bytes, bs: int, ids, n: int) -> list[bytes]:
    """The definition (the module docstring): blake2b(address of block i-1 || its ids), 16 bytes."""
    out, parent = [], salt
    for i in range(n):
        parent = hashlib.blake2b(parent + struct.pack(f"<{bs}q", *ids[i * bs:(i + 1) * bs]), digest_size=16).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
def test_addresses_are_the_chain_whatever_the_steps(bs):
    rng = random.Random(bs)
    for _ in range(50):
        ids = tuple(rng.randrange(-2**63, 2**63) if rng.random() < 0.05 else rng.randrange(1000)
                    for _ in range(rng.randrange(0, 40 * bs)))
        full = len(ids) // bs
        want = _reference(b"salt", bs, ids, full)
        h = BlockHasher(bs, b"salt")
        assert h.hashes(ids) == want
        got: list[bytes] = []
        while len(got) < full:  # extended in random steps, some past the full blocks or none at all
            before = len(got)
            assert h.extend(got, ids, before + rng.randrange(0, 5)) is got
            assert got == want[:len(got)]
        assert h.extend(got, list(ids), full + 3) == want


def test_ids_outside_int64_are_refused():
    with pytest.raises(struct.error):
        BlockHasher(2, b"").hashes([1, 2**63])


def test_prompts_sharing_a_prefix_get_the_chain_and_hash_only_what_differs():
    bs, rng = 4, random.Random(7)
    h = BlockHasher(bs, b"salt")
    digests = []
    real = h._fresh
    h._fresh = lambda: digests.append(1) or real()  # counts the blocks hashed
    base = [rng.randrange(1000) for _ in range(40 * bs)]
    for _ in range(300):
        keep = rng.randrange(0, len(base) + 1)  # diverges anywhere: mid-block, at a block's end, never
        ids = base[:keep] + [rng.randrange(1000) for _ in range(rng.randrange(0, 20 * bs))]
        if rng.random() < 0.5:
            base = ids  # the next prompt shares a prefix with this one
        last = h._last
        digests.clear()
        got = h.extend([], ids, len(ids) // bs) if rng.random() < 0.8 else h.hashes(tuple(ids))
        assert got == _reference(b"salt", bs, ids, len(ids) // bs)
        shared = 0
        while shared < min(len(got), len(last[1])) and got[shared] == last[1][shared]:
            shared += 1
        assert len(digests) == len(got) - shared  # the blocks equal to the last prompt's are not hashed
        more = h.extend(list(got), ids + [1] * bs, len(got) + 1)  # a sequence grows from its own list
        assert more == _reference(b"salt", bs, ids + [1] * bs, len(got) + 1)
