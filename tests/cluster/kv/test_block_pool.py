import pytest

from cluster.kv.block_pool import PrefixCachingBlockPool
from cluster.errors import CapacityError
from cluster.kv.kv_blocks import NULL_BLOCK


def test_never_hands_out_the_null_block():
    a = PrefixCachingBlockPool(8, 4)
    blocks = a.allocate(7)
    assert NULL_BLOCK not in blocks and len(set(blocks)) == 7
    assert a.num_free == 0 and not a.can_allocate(1)
    a.check([blocks])


def test_exhaustion_raises_and_free_returns_capacity():
    a = PrefixCachingBlockPool(4, 4)
    b = a.allocate(3)
    with pytest.raises(CapacityError):
        a.allocate(1)
    a.free(b[:2])
    assert a.num_free == 2 and a.usage() == pytest.approx(1 / 3)


def test_double_free_and_foreign_block_are_errors():
    a = PrefixCachingBlockPool(4, 4)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError):
        a.free(b)
    with pytest.raises(ValueError):
        a.free([NULL_BLOCK])


def test_freed_blocks_are_reused_last():
    a = PrefixCachingBlockPool(5, 4)
    first = a.allocate(1)
    a.free(first)
    assert first[0] not in a.allocate(3)


# -- prefix caching -----------------------------------------------------------------------------------
BS = 4


def run_prompt(pool, tokens, slots=None, count=True):
    """Allocates like a worker does, 'computes' the uncached part and registers its full blocks."""
    hashes = []
    got = pool.allocate_prompt(tokens, slots or len(tokens) + 1, hashes, count=count)
    if got is None:
        return None
    table, cached = got
    pool.cache_full_blocks(table, tokens, hashes, cached, len(tokens))
    return table, cached


def test_freed_full_blocks_are_found_again_by_content():
    pool = PrefixCachingBlockPool(16, BS)
    a = list(range(10, 20))  # 10 tokens: 2 full blocks + 2 tokens
    table, cached = run_prompt(pool, a)
    assert cached == 0 and len(table) == 3 and pool.num_cached == 2
    pool.free(table)
    assert pool.num_free == pool.capacity  # cached blocks nobody uses are still allocatable
    table2, cached2 = run_prompt(pool, a + [99, 98])
    assert cached2 == 8 and table2[:2] == table[:2]
    assert (pool.stats.queries, pool.stats.hits) == (10 + 12, 8)
    pool.check([table2])


def test_the_last_prompt_token_is_always_computed():
    pool = PrefixCachingBlockPool(16, BS)
    t, _ = run_prompt(pool, list(range(8)))  # exactly two full blocks
    pool.free(t)
    _, cached = run_prompt(pool, list(range(8)))
    assert cached == 4  # not 8: the second block is recomputed so the prefill has a last token
    assert run_prompt(pool, [5])[1] == 0


def test_a_different_prefix_or_salt_never_matches():
    pool = PrefixCachingBlockPool(16, BS)
    t, _ = run_prompt(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    pool.free(t)
    # Same second block, different first block: the chain differs from the first block on.
    assert run_prompt(pool, [0, 2, 3, 4, 5, 6, 7, 8, 9])[1] == 0
    other = PrefixCachingBlockPool(16, BS, salt=b"another model")
    assert other.hasher.hashes([1, 2, 3, 4]) != pool.hasher.hashes([1, 2, 3, 4])


def test_a_shared_block_is_never_handed_out_while_in_use():
    pool = PrefixCachingBlockPool(7, BS)  # 6 usable
    prefix = list(range(100, 108))
    a, _ = run_prompt(pool, prefix + [1])  # 3 blocks, two of them cached
    b, cached = run_prompt(pool, prefix + [2])  # shares the two: 1 fresh block
    assert cached == 8 and b[:2] == a[:2] and pool.ref_count(a[0]) == 2
    pool.free(a)
    assert pool.ref_count(a[0]) == 1 and pool.num_free == 6 - 3
    rest = pool.allocate(pool.num_free)
    assert not set(rest) & set(b)
    with pytest.raises(CapacityError):
        pool.allocate(1)
    pool.check([b, rest])


def test_eviction_only_when_no_free_block_is_left_tail_first():
    pool = PrefixCachingBlockPool(9, BS)  # 8 usable
    a, _ = run_prompt(pool, list(range(12)), slots=12)  # 3 cached blocks
    pool.free(a)
    fresh = pool.allocate(5)
    assert not set(fresh) & set(a) and pool.num_cached == 3 and pool.stats.evicted_blocks == 0
    (victim,) = pool.allocate(1)
    assert victim == a[2] and pool.num_cached == 2  # the tail goes first: the prefix stays usable
    pool.free(fresh + [victim])
    _, cached = run_prompt(pool, list(range(12)) + [7])
    assert cached == 8


def test_lru_keeps_the_recently_used_prefix():
    pool = PrefixCachingBlockPool(5, BS)  # 4 usable
    a, _ = run_prompt(pool, [1] * 8, slots=8)
    b, _ = run_prompt(pool, [2] * 8, slots=8)
    pool.free(a)
    pool.free(b)
    t, cached = run_prompt(pool, [1] * 8 + [3], slots=9)  # uses a's blocks again; b's tail is evicted
    assert cached == 8 and pool.num_cached == 3 and pool.stats.evicted_blocks == 1
    pool.free(t)
    pool.free(pool.allocate(2))  # evicts the least recently used: b's head, not a's prefix
    assert pool.stats.evicted_blocks == 2 and run_prompt(pool, [1] * 9, slots=9)[1] == 8


def test_the_same_prefix_computed_twice_at_once_keeps_one_address():
    pool = PrefixCachingBlockPool(16, BS)
    tokens = list(range(9))
    ha, hb = [], []
    a, _ = pool.allocate_prompt(tokens, 10, ha)
    b, _ = pool.allocate_prompt(tokens, 10, hb)  # a not computed yet: no hit
    assert not set(a) & set(b)
    pool.cache_full_blocks(a, tokens, ha, 0, 9)
    pool.cache_full_blocks(b, tokens, hb, 0, 9)
    assert pool.num_cached == 2 and not pool.is_cached(b[0])
    pool.free(b)
    pool.free(a)
    pool.check([])
    assert run_prompt(pool, tokens)[0][:2] == a[:2]


def test_a_lookup_that_does_not_fit_takes_nothing():
    pool = PrefixCachingBlockPool(6, BS)  # 5 usable
    t, _ = run_prompt(pool, list(range(9)), slots=9)
    pool.free(t)
    hold = pool.allocate(2)  # 3 left: the 2 cached (evictable) + ... only if reclaimed
    assert pool.num_free == 3
    # 2 hits (both evictable now) + 2 fresh needed; 3 allocatable but hits use 2 of them: no fit.
    assert pool.allocate_prompt(list(range(9)) + [1] * 4, 14, []) is None
    assert pool.num_free == 3 and pool.num_cached == 2 and pool.stats.queries == 9
    pool.check([hold])


def test_caching_off_is_a_plain_allocator():
    pool = PrefixCachingBlockPool(16, BS, enable_caching=False)
    t, _ = run_prompt(pool, list(range(9)))
    pool.free(t)
    assert run_prompt(pool, list(range(9)))[1] == 0 and pool.num_cached == 0


def test_check_finds_a_leak_and_a_double_owner():
    pool = PrefixCachingBlockPool(8, BS)
    a = pool.allocate(2)
    pool.check([a])
    with pytest.raises(AssertionError, match="disagree"):
        pool.check([a[:1]])  # a[1] is held by nobody the caller knows of: leaked
    with pytest.raises(AssertionError, match="disagree"):
        pool.check([a, a[:1]])  # a[0] in two tables but counted once


def test_random_workload_never_serves_wrong_content_or_overwrites_a_block_in_use():
    """Random prompts over a small vocabulary share prefixes; `content[b]` is what was 'computed'
    into block b. Every hit must hold exactly the prompt's tokens up to that block, every fresh block
    must be held by nobody else, and the accounting must add up after every operation."""
    import random

    for seed in range(20):
        rng = random.Random(seed)
        pool = PrefixCachingBlockPool(rng.choice([6, 10, 24]), BS)
        content: dict[int, tuple] = {}
        live: list[tuple[list[int], list[int]]] = []  # (table, tokens)
        for _ in range(200):
            if live and (rng.random() < 0.4 or pool.num_free < 3):
                table, _ = live.pop(rng.randrange(len(live)))
                pool.free(table)
            else:
                tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
                hashes = []
                got = pool.allocate_prompt(tokens, len(tokens) + 1, hashes)
                if got is None:
                    continue
                table, cached = got
                for i in range(cached // BS):
                    assert content[table[i]] == tuple(tokens[: (i + 1) * BS]), "hit with other content"
                for i in range(cached // BS, len(table)):
                    assert all(table[i] not in t for t, _ in live), "block in use handed out again"
                    content[table[i]] = tuple(tokens[: min(len(tokens), (i + 1) * BS)])
                pool.cache_full_blocks(table, tokens, hashes, cached, len(tokens))
                live.append((table, tokens))
            pool.check([t for t, _ in live])


def test_change_feed_gives_net_changes_then_a_reset_when_the_reader_fell_behind():
    pool = PrefixCachingBlockPool(5, BS, event_log_size=4)  # 4 usable blocks
    first = pool.events_since(None, 0)
    assert first.reset and first.stored == () and first.seq == 0
    a, _ = run_prompt(pool, [1] * 8, slots=8)  # stores 2
    ha = pool.hasher.hashes([1] * 8)
    ch = pool.events_since(first.epoch, first.seq)
    assert not ch.reset and ch.stored == tuple(ha) and ch.removed == () and ch.seq == 2
    pool.free(a)
    b, _ = run_prompt(pool, [2] * 12, slots=12)  # evicts a's tail, stores 3
    hb = pool.hasher.hashes([2] * 12)
    ch2 = pool.events_since(ch.epoch, ch.seq)
    assert ch2.stored == tuple(hb) and ch2.removed == (ha[1],)
    # A reader that is behind by more than the log keeps gets the whole set.
    pool.free(b)
    for i in range(6):
        pool.free(run_prompt(pool, [3 + i] * 9, slots=9)[0])
    old = pool.events_since(ch.epoch, ch.seq)
    assert old.reset and set(old.stored) == set(pool._cached)
    assert pool.events_since("another pool", pool.event_seq).reset
    assert pool.events_since(old.epoch, old.seq) == type(old)(old.epoch, old.seq, False, (), ())
    # Stored, then evicted before the next look: nets out to a removal.
    t, _ = run_prompt(pool, [9] * 5, slots=5)
    pool.free(t)
    pool.free(pool.allocate(4))
    (h9,) = pool.hasher.hashes([9] * 4)
    last = pool.events_since(old.epoch, old.seq)
    assert h9 not in last.stored and h9 in last.removed and not pool.num_cached
