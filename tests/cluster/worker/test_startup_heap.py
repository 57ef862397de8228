"""The startup heap frozen (cluster/worker/startup_heap.py): what start-up left is collected, then
frozen, so a full collection no longer walks it; a cycle made before the freeze is out of the
collector's reach until collect_including_frozen(), and one made after it is collected as always.
(The test process unfreezes afterwards: its heap is pytest's, shared with the other tests.)"""

from __future__ import annotations

import gc
import weakref

import pytest

from cluster.worker.startup_heap import collect_including_frozen, freeze_startup_heap, heap_frozen


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _cycle() -> weakref.ref:
    return weakref.ref(Node())


def test_freeze_collects_startup_garbage_then_freezes_what_lives(unfrozen):
    garbage = _cycle()  # start-up's garbage: collected before the freeze, never frozen
    live = Node()
    assert not heap_frozen()
    record = freeze_startup_heap()
    assert garbage() is None
    # (Not equal to gc.get_freeze_count() read later: another thread of this process - a cluster's, in the
    # full run - may free frozen objects meanwhile, which lowers the count.)
    assert heap_frozen() and record["frozen_objects"] > 1000
    assert record["full_collection_ms"] >= 0 and record["after_freeze_ms"] >= 0
    # The frozen heap is not in any generation: a full collection walks only what came after it.
    assert sum(len(gc.get_objects(g)) for g in range(3)) < gc.get_freeze_count() // 2
    assert live.me is live


def test_a_cycle_from_before_the_freeze_goes_only_through_collect_including_frozen(unfrozen):
    early = Node()
    ref = weakref.ref(early)
    freeze_startup_heap()
    del early  # garbage now, but frozen
    gc.collect()
    assert ref() is not None, "the collector reached the frozen heap"
    collect_including_frozen()
    assert ref() is None
    assert heap_frozen()  # frozen again, what is alive


def test_cycles_made_after_the_freeze_are_collected_as_always(unfrozen):
    freeze_startup_heap()
    late = _cycle()
    gc.collect()
    assert late() is None


def test_collect_including_frozen_without_a_freeze_is_a_full_collection(unfrozen):
    ref = _cycle()
    collect_including_frozen()
    assert ref() is None and not heap_frozen()
