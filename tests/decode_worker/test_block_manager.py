import pytest

from cluster.errors import CapacityError
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from decode_worker.block_manager import BlockManager


def alloc(bm: BlockManager, num_tokens: int) -> list[int]:
    return bm.allocator.allocate(bm.blocks_for_tokens(num_tokens))


def test_allocate_grow_and_free():
    bm = BlockManager(num_blocks=9, block_size=4)  # 8 usable
    seq = Sequence("a", list(range(4)), SamplingParams(), seed=0)
    assert bm.allocate_prompt(seq)  # 4 tokens + the first decode slot
    table = seq.block_table
    assert len(table) == 2 and 0 not in table
    assert bm.blocks_needed(table, 8) == 0 and bm.blocks_needed(table, 9) == 1
    assert bm.grow(table, 9) and len(table) == 3
    assert bm.num_free == 5
    big = Sequence("b", list(range(6 * 4)), SamplingParams(), seed=0)
    assert not bm.allocate_prompt(big) and big.block_table == []  # does not fit: nothing taken
    assert bm.num_free == 5
    assert not bm.grow(table, 9 * 4) and len(table) == 3
    bm.free_now(table)
    assert bm.num_free == 8
    with pytest.raises(ValueError):
        bm.free_now(table)  # double free is caught


def test_free_after_step_waits_for_the_step():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = alloc(bm, 8)
    bm.free_after_step(a, step=7, completed_step=6)
    assert bm.num_free == 2 and bm.num_pending_free == 2
    assert bm.step_completed(6) == 0 and bm.num_free == 2
    assert bm.step_completed(7) == 2 and bm.num_free == 4 and bm.num_pending_free == 0
    b = alloc(bm, 4)
    bm.free_after_step(b, step=3, completed_step=7)  # that step already finished: freed now
    assert bm.num_free == 4


def test_blocks_held_for_a_transfer_return_only_when_it_reports():
    bm = BlockManager(num_blocks=4, block_size=4)
    blocks = alloc(bm, 12)
    bm.hold_for_transfer("r1", blocks)
    assert bm.num_free == 0 and bm.is_held_for_transfer("r1")
    with pytest.raises(CapacityError):
        bm.allocator.allocate(1)
    assert bm.release_transfer("r1") and bm.num_free == 3
    assert not bm.release_transfer("r1")
