"""Started clusters kept by configuration, so that every module asking for the same one shares it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class ClusterCache:
    """Clusters by configuration: `get(key, start)` returns the cluster started for `key` (a hashable
    of its settings), calling `start()` the first time. Only for tests that leave their cluster as they
    found it; a test that kills, restarts or wedges a worker starts a fresh one of its own.

    An idle cluster is not free on two cores (the router polls its workers' stats every 0.1 s), so the cache
    holds at most `keep` of them (the least recently used goes first), and tests/conftest.py closes
    them all when the tests of a stretch are done (`close_all`)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.clusters: OrderedDict[tuple, object] = OrderedDict()
        self.started = 0  # how many it started, for the tests of the cache

    def get(self, key: tuple, start: Callable[[], object]):
        if key in self.clusters:
            self.clusters.move_to_end(key)
            return self.clusters[key]
        while len(self.clusters) >= self.keep:
            _, old = self.clusters.popitem(last=False)
            old.shutdown()
        sc = self.clusters[key] = start()
        self.started += 1
        return sc

    def close_all(self) -> None:
        while self.clusters:
            _, sc = self.clusters.popitem(last=False)
            sc.shutdown()
