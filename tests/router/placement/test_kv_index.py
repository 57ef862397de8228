"""KVBlockIndex fed by real block pools' change feeds: overlaps per worker, resets, dead workers."""

from cluster.kv.block_pool import PrefixCachingBlockPool
from cluster.wire.messages import KVCacheEvents
from router.placement.kv_index import KVBlockIndex

BS = 4


class Worker:
    def __init__(self, wid, num_blocks=32, salt=b"s", log=64):
        self.id, self.salt = wid, salt
        self.pool = PrefixCachingBlockPool(num_blocks, BS, salt, event_log_size=log)

    def run(self, tokens):
        hashes = []
        table, cached = self.pool.allocate_prompt(tokens, len(tokens) + 1, hashes)
        self.pool.cache_full_blocks(table, tokens, hashes, cached, len(tokens))
        self.pool.free(table)

    def poll(self, index):
        epoch, seq = index.position(self.id)
        index.apply(KVCacheEvents(self.id, self.salt, BS, self.pool.events_since(epoch, seq)))


def test_overlap_follows_what_each_worker_caches():
    index, a, b = KVBlockIndex(), Worker("a"), Worker("b")
    assert index.hashes(list(range(20))) == ()  # nothing reported yet: no address space
    system = list(range(100, 112))  # 3 blocks
    a.run(system + [1, 2, 3, 4, 5])  # a: 4 full blocks
    b.run(system[:8] + [9] * 6)  # b: shares the first 2 blocks
    for w in (a, b):
        w.poll(index)
    hashes = index.hashes(system + [1, 2, 3, 4, 7, 7])  # 18 tokens: 4 blocks may be hits
    assert len(hashes) == 4
    assert index.overlap(hashes, ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert index.overlap(index.hashes([5] * 9), ["a", "b"]) == {"a": 0, "b": 0}


def test_evictions_reach_the_index_and_a_lagging_reader_is_reset():
    index, a = KVBlockIndex(), Worker("a", num_blocks=6, log=2)  # 5 usable
    a.run(list(range(12)))  # 3 cached
    a.poll(index)
    assert index.num_blocks("a") == 3
    for k in range(3):  # evicts everything, more events than the log keeps
        a.run([50 + k] * 9)
    a.poll(index)
    assert index.num_blocks("a") == a.pool.num_cached
    assert index.overlap(index.hashes(list(range(12)) + [0]), ["a"]) == {"a": 0}
    a.pool.check([])


def test_a_dead_worker_is_forgotten_and_a_new_incarnation_read_from_scratch():
    index, a = KVBlockIndex(), Worker("a")
    a.run(list(range(9)))
    a.poll(index)
    index.drop("a")
    assert index.num_blocks("a") == 0 and index.position("a") == (None, 0)
    a2 = Worker("a")  # same id, new pool: its epoch differs, so it sends its whole set
    a2.run(list(range(5)))
    index.apply(KVCacheEvents("a", a2.salt, BS, a2.pool.events_since("stale-epoch", 99)))
    assert index.num_blocks("a") == 1


def test_a_worker_with_another_address_space_replaces_the_index():
    index, a, b = KVBlockIndex(), Worker("a", salt=b"x"), Worker("b", salt=b"y")
    a.run(list(range(9)))
    a.poll(index)
    b.run(list(range(9)))
    b.poll(index)
    assert index.num_blocks("a") == 0 and index.num_blocks("b") == 2


def test_a_prompt_is_hashed_once_per_address_space(monkeypatch):
    from cluster.kv.block_hash import BlockHasher

    index, a, b = KVBlockIndex(), Worker("a"), Worker("b", salt=b"other")
    a.run(list(range(20)))
    b.run(list(range(20)))
    a.poll(index)
    calls = []
    real = BlockHasher.extend
    monkeypatch.setattr(BlockHasher, "extend", lambda self, *args: calls.append(1) or real(self, *args))
    prompt = tuple(range(40))
    first = index.hashes(prompt)
    assert index.hashes(prompt) is first and len(calls) == 1  # the walk and the policies ask again
    assert index.hashes(tuple(range(40))) == first and len(calls) == 2  # another request's tuple
    ids = list(prompt)
    index.hashes(ids)
    ids[0] = 99  # a list may change under the same identity: never kept
    assert index.hashes(ids) != first and len(calls) == 4
    b.poll(index)  # a new address space: the index starts over, and so do the prompt's hashes
    assert index.hashes(prompt) != first and len(calls) == 5
