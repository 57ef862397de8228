"""The transfer plan both sides compute: every (block, layer) exactly once, layer-major, each launch one
message within a staging slot; the PlanSpec both ends check when a pair forms."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.transport.plan import (Launch, PlanSpec, bundle_blocks, fingerprint, plan_copies, plan_item,
                                    plan_launches)

MiB = 1 << 20


def spec(layers=32, chunk=32 * MiB, **kw) -> PlanSpec:
    """8B shape, bf16: a plane block (one block's K or V of one layer) is 32 KiB."""
    d = dict(payload="torch_dist/nccl", num_layers=layers, block_size=16, kv_heads=8, head_dim=128,
             dtype="bfloat16", elem_bytes=2, chunk_bytes=chunk)
    d.update(kw)
    return PlanSpec(**d)


def _covered(launches, n_blocks, layers):
    seen = [(layer, b) for la in launches for layer in range(la.l0, la.l1) for b in range(la.b0, la.b1)]
    assert sorted(seen) == [(layer, b) for layer in range(layers) for b in range(n_blocks)]  # each once
    return seen


def test_plan_spec_sizes_and_checks():
    s = spec()
    assert s.plane_block_bytes == 32 << 10 and s.block_bytes == 2 * 32 * (32 << 10)
    assert PlanSpec.from_wire(s.to_wire(), "d0") == s
    s.check_peer(spec(), "d0")
    with pytest.raises(RuntimeError, match=r"mismatch with d0.*'dtype': \('bfloat16', 'float16'\)"):
        s.check_peer(spec(dtype="float16"), "d0")
    with pytest.raises(RuntimeError, match="chunk_bytes"):
        s.check_peer(spec(chunk=64 * MiB), "d0")  # the plans would differ: refused when the pair forms
    with pytest.raises(RuntimeError, match="not a PlanSpec of this version"):
        PlanSpec.from_wire([32, 16, 8, 128, "bfloat16"], "d0")  # the old list layout
    with pytest.raises(ValueError, match="cannot hold one block"):
        spec(chunk=32 << 10)  # K and V of one block of one layer are 64 KiB


def test_a_short_prompt_is_one_launch_and_a_long_one_layer_groups():
    assert plan_launches(spec(), 8) == [Launch(0, 32, 0, 8)]  # 16 MiB: one message
    groups = plan_launches(spec(), 128)  # 2048 tokens: 8 MiB a layer, 4 layers a slot
    assert groups == [Launch(4 * i, 4 * i + 4, 0, 128) for i in range(8)]
    assert all(la.nbytes(spec()) == 32 * MiB for la in groups)
    odd = plan_launches(spec(), 96)  # 6 MiB a layer: 5 layers a slot, the smallest group last
    assert [la.layers for la in odd] == [5, 5, 5, 5, 5, 5, 2] and [la.last_layer for la in odd][-1] == 31


def test_a_layer_too_large_for_a_slot_goes_in_windows_of_blocks():
    launches = plan_launches(spec(), 1000)  # 62.5 MiB a layer: two windows of 500 blocks
    assert len(launches) == 64 and launches[:2] == [Launch(0, 1, 0, 500), Launch(0, 1, 500, 1000)]
    assert all(la.nbytes(spec()) <= 32 * MiB for la in launches)
    _covered(launches, 1000, 32)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 600), st.integers(1, 40), st.integers(1, 64))
def test_any_plan_covers_everything_once_layer_major_within_a_slot(n_blocks, layers, chunk_planes):
    s = spec(layers=layers, chunk=chunk_planes * (32 << 10) + (32 << 10))  # >= 2 plane blocks
    launches = plan_launches(s, n_blocks)
    seen = _covered(launches, n_blocks, layers)
    assert [layer for layer, _ in seen] == sorted(layer for layer, _ in seen)  # layer i before layer i+1
    assert all(0 < la.nbytes(s) <= s.chunk_bytes for la in launches)
    lasts = [la.last_layer for la in launches]
    assert lasts == sorted(lasts)  # layer-wise shipping issues them in plan order
    assert fingerprint([plan_item(range(n_blocks), range(n_blocks))], launches) == \
        fingerprint([plan_item(range(n_blocks), range(n_blocks))], plan_launches(s, n_blocks))


def test_bundle_blocks_concatenate_items_in_order():
    items = [plan_item([5, 3], [10, 11]), plan_item([9], [2])]
    assert bundle_blocks(items, "src") == [5, 3, 9] and bundle_blocks(items, "dst") == [10, 11, 2]
    with pytest.raises(ValueError):
        plan_item([1, 2], [3])


def test_fingerprint_tells_plans_apart():
    a, b = [plan_item([1, 2, 3], [4, 5, 6])], [plan_item([1, 2], [4, 5]), plan_item([3], [6])]
    la = plan_launches(spec(layers=4), 3)
    assert fingerprint(a, la) != fingerprint(b, la)  # same blocks, other items
    assert fingerprint(a, la) != fingerprint(a, plan_launches(spec(layers=4, chunk=128 << 10), 3))


def test_copy_plans():
    assert plan_copies(spec(), 5, layerwise=True) == [Launch(i, i + 1, 0, 5) for i in range(32)]
    assert plan_copies(spec(), 5, layerwise=False) == [Launch(0, 32, 0, 5)]
    _covered(plan_copies(spec(layers=5), 3, True), 3, 5)
