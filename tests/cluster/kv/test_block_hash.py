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
