"""DecodeScheduler on CPU with fake device outputs (no model): the pipelined step protocol."""

from cluster.sampling_params import SamplingParams
from cluster.sequence import Sequence, SequenceStatus
from decode_worker.block_manager import BlockManager
from decode_worker.scheduler import DecodeScheduler

EOS = 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=1024):
    return DecodeScheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_prefill_tokens=64,
                           max_model_len=max_model_len)


def seq(rid, prompt_len=5, max_tokens=8, ignore_eos=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return Sequence(rid, list(range(10, 10 + prompt_len)), params, seed=0, eos_token_ids=(EOS,))


def arrive(s: DecodeScheduler, sq: Sequence, first=100):
    assert s.reserve(sq) is not None
    return s.on_arrival(sq.request_id, first, ok=True)


def test_reserve_covers_prompt_plus_one_and_respects_capacity():
    s = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2)
    a = seq("a", prompt_len=7)  # 8 tokens -> 2 blocks
    assert len(s.reserve(a)) == 2 and a.status is SequenceStatus.WAITING_FOR_KV
    assert s.reserve(seq("b", prompt_len=8)) is None  # 9 tokens -> 3 blocks, 2 free
    assert s.reserve(seq("c", prompt_len=3)) is not None
    assert s.reserve(seq("d", prompt_len=1)) is None  # max_num_seqs reached


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


def test_short_pool_drains_then_preempts_newest_for_recompute():
    s = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
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
    assert [(x.request_id, c.start, len(c.token_ids)) for x, c in chunks] == [("b", 0, b.num_tokens)]
    done = s.on_prefill_done(chunks)
    d = s.on_prefill_token(done[0], 9)
    assert d.token_ids == (9,) and b in s.running
