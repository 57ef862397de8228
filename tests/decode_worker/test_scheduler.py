"""DecodeScheduler on CPU with fake device outputs (no model): the pipelined step protocol."""

import pytest

from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence, SequenceStatus
from decode_worker.block_manager import BlockManager
from decode_worker.scheduler import DecodeScheduler

EOS = 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=1024, caching=True):
    return DecodeScheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=caching), max_num_seqs,
                           max_prefill_tokens=64, max_model_len=max_model_len)


def seq(rid, prompt_len=5, max_tokens=8, ignore_eos=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return Sequence(rid, list(range(10, 10 + prompt_len)), params, seed=0, eos_token_ids=(EOS,))


def arrive(s: DecodeScheduler, sq: Sequence, first=100):
    assert s.reserve(sq)
    return s.on_arrival(sq.request_id, first, ok=True)


def test_reserve_covers_prompt_plus_one_and_respects_capacity():
    s = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2)
    a = seq("a", prompt_len=7)  # 8 tokens -> 2 blocks
    assert s.reserve(a) and len(a.block_table) == 2 and a.status is SequenceStatus.WAITING_FOR_KV
    assert not s.reserve(seq("b", prompt_len=8))  # 9 tokens -> 3 blocks, 2 free
    assert s.reserve(seq("c", prompt_len=3))
    assert not s.reserve(seq("d", prompt_len=1))  # max_num_seqs reached


def test_pipelined_steps_feed_tokens_on_device_and_join_leave():
    s = make_scheduler()
    a = seq("a", max_tokens=3)
    d = arrive(s, a, first=100)
    assert d.token_ids == (100,) and d.finish_reason is None
    b0 = s.schedule_decode(0, pipeline_busy=False)
    assert [(r.seq.request_id, r.token_id, r.prev_row, r.position) for r in b0.rows] == [("a", 100, -1, 5)]
    s.on_step_launched(b0)
    # b joins while step 0 is in flight; a's next input is step 0's row 0, one position further.
    b = seq("b", prompt_len=2, max_tokens=5)
    arrive(s, b, first=200)
    b1 = s.schedule_decode(1, pipeline_busy=True)
    assert [(r.seq.request_id, r.token_id, r.prev_row, r.position) for r in b1.rows] == [("a", 0, 0, 6), ("b", 200, -1, 2)]
    s.on_step_launched(b1)
    assert [d.token_ids for d in s.on_step_output(b0, [101])] == [(101,)]
    # a's third token (max_tokens=3) is the one in flight in step 1: a gets no row in step 2.
    b2 = s.schedule_decode(2, pipeline_busy=True)
    assert [(r.seq.request_id, r.prev_row) for r in b2.rows] == [("b", 1)]
    s.on_step_launched(b2)
    out = s.on_step_output(b1, [102, 201])
    assert [(d.request_id, d.token_ids, d.finish_reason) for d in out] == [("a", (102,), "length"), ("b", (201,), None)]
    assert a.output_token_ids == [100, 101, 102] and a not in s.running
    # a's blocks wait for step 1 (the last one that included it) - it completed, so they are free.
    assert s.blocks.num_pending_free == 0
    s.on_step_output(b2, [202])
    assert b.output_token_ids == [200, 201, 202]


def test_eos_is_seen_one_step_late_and_the_extra_row_is_dropped():
    s = make_scheduler()
    a = seq("a", max_tokens=10, ignore_eos=False)
    arrive(s, a)
    b0 = s.schedule_decode(0, False)
    s.on_step_launched(b0)
    b1 = s.schedule_decode(1, True)  # a still runs: step 0's EOS is not known yet
    s.on_step_launched(b1)
    used = s.blocks.capacity - s.blocks.num_free
    assert [d.finish_reason for d in s.on_step_output(b0, [EOS])] == ["stop"]
    # Step 1 may still write a's KV: its blocks are held until step 1 completes.
    assert s.blocks.num_pending_free == used
    assert s.on_step_output(b1, [55]) == []  # the extra token is discarded
    assert a.output_token_ids == [100, EOS] and s.blocks.num_free == s.blocks.capacity


def test_abort_of_a_running_sequence_defers_the_free_past_the_step_in_flight():
    s = make_scheduler()
    a = seq("a")
    arrive(s, a)
    b0 = s.schedule_decode(0, False)
    s.on_step_launched(b0)
    assert s.abort("a", transfer_pending=False)
    assert s.blocks.num_pending_free > 0 and s.blocks.num_free < s.blocks.capacity
    assert s.on_step_output(b0, [7]) == []
    assert s.blocks.num_free == s.blocks.capacity


def test_abort_while_transfer_pending_holds_blocks_until_it_reports():
    s = make_scheduler()
    a = seq("a", prompt_len=20)
    s.reserve(a)
    assert s.abort("a", transfer_pending=True)
    assert s.blocks.num_free < s.blocks.capacity  # a late transfer could still write them
    assert s.on_arrival("a", 5, ok=True) is None  # the transfer reported: now they are free
    assert s.blocks.num_free == s.blocks.capacity and not s.running


def test_failed_arrival_frees_and_reports_error():
    s = make_scheduler()
    a = seq("a")
    s.reserve(a)
    d = s.on_arrival("a", None, ok=False, error="prefill worker died")
    assert d.finish_reason == "error" and d.error == "prefill worker died"
    assert s.blocks.num_free == s.blocks.capacity and not s.running


@pytest.mark.parametrize("caching", [True, False])
def test_short_pool_drains_then_preempts_newest_for_recompute(caching):
    s = make_scheduler(num_blocks=5, block_size=4, caching=caching)  # 4 usable blocks
    a, b = seq("a", prompt_len=3, max_tokens=20), seq("b", prompt_len=3, max_tokens=20)
    arrive(s, a)
    arrive(s, b)  # each holds 1 block (3 prompt + 1)
    prev, step = None, 0
    while True:
        batch = s.schedule_decode(step, pipeline_busy=prev is not None)
        if batch.needs_drain:
            s.on_step_output(prev, [7] * prev.size)
            prev = None
            batch = s.schedule_decode(step, pipeline_busy=False)
        if batch.preempted:
            break
        s.on_step_launched(batch)
        if prev is not None:
            s.on_step_output(prev, [7] * prev.size)
        prev, step = batch, step + 1
    assert [x.request_id for x in batch.preempted] == ["b"]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and s.num_preemptions == 1
    assert [r.seq.request_id for r in batch.rows] == ["a"]
    # Recompute: b gets blocks for everything it has once they are free, and is prefilled again.
    s.on_step_launched(batch)
    s.on_step_output(batch, [7])
    s.abort("a", transfer_pending=False)
    s.readmit_preempted()
    chunks = s.schedule_prefill()
    # With caching, b's full blocks (prompt and decoded tokens) are still cached: only its last,
    # partial block is recomputed.
    start = (b.num_tokens - 1) // 4 * 4 if caching else 0
    assert [(x.request_id, c.start, len(c.token_ids)) for x, c in chunks] == [("b", start, b.num_tokens - start)]
    done = s.on_prefill_done(chunks)
    d = s.on_prefill_token(done[0], 9)
    assert d.token_ids == (9,) and b in s.running


# -- prefix caching -------------------------------------------------------------------------------------
def test_an_arrived_prompt_is_cached_and_a_local_prefill_starts_after_it():
    s = make_scheduler()
    a = seq("a", prompt_len=10, max_tokens=4)
    arrive(s, a)
    # Same first 8 tokens (two full blocks), then different ones.
    b = Sequence("b", list(range(10, 18)) + [99, 98, 97], SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True), seed=0)
    assert s.add_local(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [s.blocks.allocator.ref_count(x) for x in a.block_table[:2]] == [2, 2]
    chunks = s.schedule_prefill()
    assert [(x.request_id, c.start, list(c.token_ids)) for x, c in chunks] == [("b", 8, [99, 98, 97])]
    s.on_prefill_token(s.on_prefill_done(chunks)[0], 5)
    s.check_blocks()
    stats = s.blocks.prefix_cache_stats
    assert (stats.queries, stats.hits) == (10 + 11, 8)  # a's reservation found nothing, b its 2 blocks
    # a leaves while b still uses the shared blocks: they stay in use, b's table intact.
    s.abort("a", transfer_pending=False)
    assert [s.blocks.allocator.ref_count(x) for x in b.block_table[:2]] == [1, 1]
    s.check_blocks()
    s.abort("b", transfer_pending=False)
    s.check_blocks()
    assert s.blocks.num_free == s.blocks.capacity and s.blocks.num_cached_blocks == 2


def test_a_reservation_takes_the_cached_prefix_and_the_transfer_lands_after_it():
    s = make_scheduler()
    a = seq("a", prompt_len=10, max_tokens=4)
    arrive(s, a)
    b = Sequence("b", list(range(10, 19)) + [7] * 6, SamplingParams(max_tokens=4, temperature=0.0,
                                                                      ignore_eos=True), seed=0)
    assert s.reserve(b) and b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    landing = b.block_table[2:]
    assert not any(s.blocks.allocator.is_cached(x) for x in landing)
    # Aborted with the transfer in flight: the whole table is held until it reports; then the shared
    # blocks are still a's, the landing ones free.
    assert s.abort("b", transfer_pending=True)
    s.check_blocks()
    assert s.on_arrival("b", 5, ok=True) is None
    assert [s.blocks.allocator.ref_count(x) for x in a.block_table[:2]] == [1, 1]
    s.check_blocks()
    # A reservation that lands: its blocks past the cached prefix are registered on arrival.
    c = Sequence("c", list(range(10, 19)) + [3] * 8, SamplingParams(max_tokens=4, temperature=0.0,
                                                                      ignore_eos=True), seed=0)
    assert s.reserve(c) and c.num_cached_tokens == 8
    s.on_arrival("c", 5, ok=True)
    assert c.num_cached_tokens == 17 and all(s.blocks.allocator.is_cached(x) for x in c.block_table[:4])
    s.check_blocks()


def test_a_decoded_block_is_cached_once_the_step_that_filled_it_completed():
    s = make_scheduler()
    a = seq("a", prompt_len=6, max_tokens=10)  # block 1 holds prompt tokens 4, 5; decode fills it
    arrive(s, a, first=100)  # token 6 = 100
    assert s.blocks.num_cached_blocks == 1
    b0 = s.schedule_decode(0, False)  # writes position 6
    s.on_step_launched(b0)
    b1 = s.schedule_decode(1, True)  # writes position 7: block 1 full once step 1 completes
    s.on_step_launched(b1)
    s.on_step_output(b0, [101])
    assert s.blocks.num_cached_blocks == 1
    s.on_step_output(b1, [102])
    assert s.blocks.num_cached_blocks == 2 and s.blocks.allocator.is_cached(a.block_table[1])
    s.check_blocks()
    # The cached content is the sequence's own tokens: a prompt resending them finds both blocks.
    c = Sequence("c", a.all_token_ids[:8] + [1], SamplingParams(max_tokens=2), seed=0)
    assert s.add_local(c) and c.num_cached_tokens == 8


def test_caching_off_finds_nothing():
    s = make_scheduler(caching=False)
    a = seq("a", prompt_len=10)
    arrive(s, a)
    b = seq("b", prompt_len=10)
    assert s.add_local(b) and b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert s.blocks.num_cached_blocks == 0
