"""The transfer plan both sides compute: every (item, layer) exactly once, in order, within limits."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.transport.plan import (MAX_DIRECT_RUNS, MAX_MESSAGES_PER_LAUNCH, Segment, block_runs, fingerprint,
                                    launch_last_layer, plan_copies, plan_item, plan_launches)

PBB = 32 << 10  # one (layer, K/V) plane of a block: 8B shape, bf16


def test_block_runs():
    assert block_runs([1, 2, 3, 7], [5, 6, 7, 8]) == ((1, 5, 3), (7, 8, 1))
    assert block_runs([4], [9]) == ((4, 9, 1),)


def test_items_go_direct_only_in_few_large_runs():
    big = list(range(1, 129))  # 128 blocks = 4 MiB per message
    assert plan_item(big, [b + 100 for b in big], PBB, 4 << 20).runs == ((1, 101, 128),)
    assert plan_item(big[:8], big[:8], PBB, 4 << 20).runs is None  # 256 KiB messages: not worth their host cost
    frag = random.Random(0).sample(range(1, 1000), 128)
    assert plan_item(big, frag, PBB, 0).runs is None  # more than MAX_DIRECT_RUNS runs
    four = [1, 2, 10, 11, 20, 21, 30, 31]
    assert len(plan_item(four, four, PBB, 0).runs) == 4 == MAX_DIRECT_RUNS


def _covered(launches, n_items, layers):
    seen = [(s.item, layer) for la in launches for s in la for layer in range(s.l0, s.l1)]
    assert sorted(seen) == [(i, layer) for i in range(n_items) for layer in range(layers)]
    return seen


def test_layerwise_launches_follow_the_layers():
    items = [plan_item(range(1, 9), range(20, 28), PBB, 0), plan_item([3, 9, 4], [5, 6, 7], PBB, 1 << 30)]
    launches = plan_launches(items, 32, PBB, layerwise=True, slot_bytes=64 << 20)
    assert len(launches) == 32 and [launch_last_layer(la) for la in launches] == list(range(32))
    assert all({s.item for s in la} == {0, 1} for la in launches)  # both prompts ride each layer's launch
    _covered(launches, 2, 32)


def test_one_launch_for_a_short_staged_prompt_and_pipelined_chunks_for_a_long_one():
    short = plan_item(range(1, 9), range(1, 9), PBB, 4 << 20)  # 8 blocks: staged, 16 MiB in all
    assert plan_launches([short], 32, PBB, False, 64 << 20) == [(Segment(0, 0, 32),)]
    long = plan_item(range(1, 129), random.Random(1).sample(range(1, 4000), 128), PBB, 4 << 20)  # 268 MB staged
    launches = plan_launches([long], 32, PBB, False, 64 << 20)
    assert len(launches) == 4 and all(long.staged_bytes(s.l1 - s.l0, PBB) <= 64 << 20 for la in launches for s in la)
    direct = plan_item(range(1, 129), range(1, 129), PBB, 4 << 20)
    launches = plan_launches([direct], 32, PBB, False, 64 << 20)
    assert [sum(direct.messages(s.l1 - s.l0) for s in la) for la in launches] == [MAX_MESSAGES_PER_LAUNCH] * 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 12), st.booleans(),
       st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_any_plan_covers_everything_once_within_limits(sizes, layers, layerwise, slot_blocks, seed):
    rng = random.Random(seed)
    items = []
    for n in sizes:
        src = rng.sample(range(1, 200), n) if rng.random() < 0.5 else list(range(5, 5 + n))
        dst = rng.sample(range(1, 200), n) if rng.random() < 0.5 else list(range(50, 50 + n))
        items.append(plan_item(src, dst, PBB, rng.choice([0, 4 * PBB, 1 << 30])))
    slot = slot_blocks * 2 * PBB * 8
    launches = plan_launches(items, layers, PBB, layerwise, slot)
    seen = _covered(launches, len(items), layers)
    if layerwise:  # layer-major: layer i's launches all come before layer i+1's
        assert [layer for _, layer in seen] == sorted(layer for _, layer in seen)
        assert all(len({s.l0 for s in la}) == 1 for la in launches)
    else:  # item-major, each item's layers in order
        assert [i for i, _ in seen] == sorted(i for i, _ in seen)
    for la in launches:
        msgs = sum(items[s.item].messages(s.l1 - s.l0) for s in la)
        staged = sum(items[s.item].staged_bytes(s.l1 - s.l0, PBB) for s in la)
        assert len(la) == 1 or (msgs <= MAX_MESSAGES_PER_LAUNCH and staged <= slot)
    assert fingerprint(items, launches) == fingerprint(list(items), plan_launches(items, layers, PBB, layerwise, slot))


def test_fingerprint_tells_plans_apart():
    a = [plan_item([1, 2, 3], [4, 5, 6], PBB, 0)]
    b = [plan_item([1, 2, 3], [4, 5, 6], PBB, 1 << 30)]  # same blocks, staged instead of direct
    la, lb = plan_launches(a, 4, PBB, False, 1 << 20), plan_launches(b, 4, PBB, False, 1 << 20)
    assert fingerprint(a, la) != fingerprint(b, lb)


def test_copy_plans():
    assert len(plan_copies(3, 32, layerwise=True)) == 32 and len(plan_copies(3, 32, layerwise=False)) == 1
    _covered(plan_copies(3, 5, True), 3, 5)
    _covered(plan_copies(3, 5, False), 3, 5)
