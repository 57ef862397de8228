"""tests/cluster_cache.py: one cluster per configuration, the least recently used one shut down past
`keep`, all of them by close_all (the end of a group of modules)."""

from __future__ import annotations

from cluster_cache import ClusterCache


class _Cluster:
    def __init__(self, name: str):
        self.name, self.down = name, False

    def shutdown(self) -> None:
        assert not self.down, "shut down twice"
        self.down = True


def test_one_cluster_per_configuration_lru_past_keep_and_close_all():
    cache = ClusterCache(keep=2)
    a = cache.get(("a",), lambda: _Cluster("a"))
    assert cache.get(("a",), lambda: _Cluster("again")) is a and cache.started == 1
    b = cache.get(("b",), lambda: _Cluster("b"))
    cache.get(("a",), lambda: _Cluster("again"))  # a is now the most recently used
    c = cache.get(("c",), lambda: _Cluster("c"))
    assert b.down and not a.down and not c.down and cache.started == 3
    b2 = cache.get(("b",), lambda: _Cluster("b2"))  # started anew, a (least recent) goes
    assert b2 is not b and a.down and not c.down
    cache.close_all()
    assert c.down and b2.down and not cache.clusters
