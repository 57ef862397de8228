"""Prefix caching in the reference engine: a prompt's cached leading blocks are not computed again, and
greedy output is token for token what it is with caching off, on the demo model, Qwen2 (attention
bias) and Mistral (sliding window, crossed by the shared prefix), through preemption and eviction."""

import random

import pytest

from cluster.engine.engine import LLMEngine
from cluster.sampling.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(params=["demo_model_dir", "qwen2_model_dir", "mistral_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def tokens(rng, n):
    return [rng.randrange(5, 500) for _ in range(n)]


class Counting:
    """Counts the prompt tokens an engine actually computes (prefill passes)."""

    def __init__(self, engine: LLMEngine):
        self.computed = 0
        prefill = engine.runner.prefill

        def counted(chunks, *a, **kw):
            self.computed += sum(len(c.token_ids) for c in chunks)
            return prefill(chunks, *a, **kw)
        engine.runner.prefill = counted


def multi_turn(engine: LLMEngine, system, users_per_session, params=GREEDY):
    """Sessions that share `system`; each turn resends the whole conversation so far (prompt + the
    answer actually generated), as a chat client does. Returns every turn's output tokens."""
    history = [[0] + system for _ in users_per_session]
    outs = []
    for turn in range(len(users_per_session[0])):
        prompts = [h + users[turn] for h, users in zip(history, users_per_session)]
        got = engine.generate(prompts, params)
        outs.append([o.token_ids for o in got])
        history = [p + list(o.token_ids) for p, o in zip(prompts, got)]
    return outs


def test_multi_turn_greedy_output_is_exact_and_the_prefix_is_not_recomputed(model_dir):
    rng = random.Random(1)
    system = tokens(rng, 130)  # longer than Mistral's 96-token window
    users = [[tokens(rng, rng.randrange(3, 40)) for _ in range(3)] for _ in range(3)]
    off = LLMEngine(model_dir, dtype="float32", enable_prefix_caching=False)
    on = LLMEngine(model_dir, dtype="float32")
    count_off, count_on = Counting(off), Counting(on)
    ref = multi_turn(off, system, users)
    got = multi_turn(on, system, users)
    assert got == ref
    stats = on.allocator.stats
    assert off.allocator.stats.hits == 0 and count_off.computed == stats.queries
    # Turn 1: the three sessions start in one batch (nothing cached yet); turns 2 and 3 find at least
    # the system prompt and every earlier turn (answers included: decoded blocks are cached too).
    assert stats.hits == stats.queries - count_on.computed
    assert stats.hits >= 3 * 2 * (131 // 16) * 16
    assert on.allocator.num_used == 0
    on.allocator.check([])


def test_a_prefix_cached_by_an_earlier_batch_is_shared_by_a_running_one(demo_model_dir):
    rng = random.Random(2)
    shared = [0] + tokens(rng, 70)
    prompts = [shared + tokens(rng, n) for n in (1, 9, 30, 17)]
    off = LLMEngine(demo_model_dir, dtype="float32", enable_prefix_caching=False)
    ref = off.generate(prompts, GREEDY)
    on = LLMEngine(demo_model_dir, dtype="float32")
    on.generate([shared + [7]], SamplingParams(max_tokens=1))
    seqs = [on.add_request(p, GREEDY) for p in prompts]
    on.step()  # one packed prefill of the four suffixes, all on the same cached blocks
    table = seqs[0].block_table[:4]
    assert all(s.block_table[:4] == table for s in seqs)
    assert all(on.allocator.ref_count(b) == 4 for b in table)
    while on.has_work():
        on.step()
    assert [on.output_of(s).token_ids for s in seqs] == [r.token_ids for r in ref]


def test_preemption_recomputes_only_what_was_evicted_and_stays_exact(demo_model_dir):
    rng = random.Random(3)
    shared = [0] + tokens(rng, 20)
    prompts = [shared + tokens(rng, n) for n in (3, 11, 6, 14)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(demo_model_dir, enable_prefix_caching=False).generate(prompts, params)

    def run(enable):
        # 29 usable blocks of 4 tokens cannot hold all four sequences at once: the engine must preempt.
        tight = LLMEngine(demo_model_dir, block_size=4, num_blocks=30, max_prefill_tokens=16,
                          enable_prefix_caching=enable)
        counting = Counting(tight)
        seqs = [tight.add_request(p, params) for p in prompts]
        preempted = 0
        while tight.has_work():
            before = len(tight.running)
            finished = tight.step()
            preempted += max(0, before - len(tight.running) - len(finished))
            tight.allocator.check([s.block_table for s in tight.running + list(tight.waiting)])
        assert preempted > 0
        assert [tight.output_of(s).token_ids for s in seqs] == [r.token_ids for r in ref]
        assert tight.allocator.num_used == 0
        return counting.computed, tight.allocator.stats

    computed_off, _ = run(False)
    computed_on, stats = run(True)
    # The shared prefix is computed once, and a preempted sequence takes its own full blocks back
    # from the cache (uncounted in the hit statistics: they are its own).
    assert computed_on < computed_off - 3 * 16
    # Prompt 1 is admitted while prompt 0's second chunk is computed: it finds 4 of the 5 shared
    # blocks; prompts 2 and 3 find all five.
    assert stats.hits == 16 + 2 * 20 and stats.queries == sum(len(p) for p in prompts)


def test_a_cache_that_must_evict_stays_exact(model_dir):
    rng = random.Random(4)
    prefixes = [[0] + tokens(rng, 60) for _ in range(4)]
    # 4 prefixes x 4 blocks do not fit next to the running requests in 20 usable blocks of 16.
    prompts = [prefixes[i % 4] + tokens(rng, 5 + i) for i in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(model_dir, dtype="float32", enable_prefix_caching=False).generate(prompts, params)
    on = LLMEngine(model_dir, dtype="float32", num_blocks=21, max_num_seqs=2)
    got = [on.generate([p], params)[0].token_ids for p in prompts[:4]]  # each prefix cached once
    got += [o.token_ids for o in on.generate(prompts[4:], params)]
    assert got == [r.token_ids for r in ref]
    assert on.allocator.stats.evicted_blocks > 0 and on.allocator.stats.hits > 0
    on.allocator.check([])
