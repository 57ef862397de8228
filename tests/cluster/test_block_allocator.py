import pytest

from cluster.block_allocator import BlockAllocator
from cluster.errors import CapacityError
from cluster.kv_cache import NULL_BLOCK


def test_never_hands_out_the_null_block():
    a = BlockAllocator(8)
    blocks = a.allocate(7)
    assert NULL_BLOCK not in blocks and len(set(blocks)) == 7
    assert a.num_free == 0 and not a.can_allocate(1)


def test_exhaustion_raises_and_free_returns_capacity():
    a = BlockAllocator(4)
    b = a.allocate(3)
    with pytest.raises(CapacityError):
        a.allocate(1)
    a.free(b[:2])
    assert a.num_free == 2 and a.usage() == pytest.approx(1 / 3)


def test_double_free_and_foreign_block_are_errors():
    a = BlockAllocator(4)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError):
        a.free(b)
    with pytest.raises(ValueError):
        a.free([NULL_BLOCK])


def test_freed_blocks_are_reused_last():
    a = BlockAllocator(5)
    first = a.allocate(1)
    a.free(first)
    assert first[0] not in a.allocate(3)
