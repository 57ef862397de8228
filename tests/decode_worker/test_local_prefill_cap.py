"""The local-prefill chunk cap inside the decode loop, on CPU with the real DecodeWorker: while requests
decode, a long local prompt is prefilled at most `local_prefill_chunk_tokens` per loop iteration and
every chunk is followed by a decode step of the running requests; outputs still equal the engine's."""

import random
import time

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.sequence import Sequence
from decode_worker.block_manager import BlockManager
from decode_worker.decode_worker import DecodeWorker
from decode_worker.scheduler import DecodeScheduler

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(seed, n):
    rng = random.Random(seed)
    return [0] + [rng.randrange(5, 500) for _ in range(n - 1)]


def test_scheduler_budget_caps_the_chunk_fcfs():
    s = DecodeScheduler(BlockManager(64, 16), max_num_seqs=8, max_prefill_tokens=512, max_model_len=1024)
    a = Sequence("a", list(range(5, 105)), SamplingParams(max_tokens=4), 0, (1,))
    b = Sequence("b", list(range(5, 25)), SamplingParams(max_tokens=4), 0, (1,))
    assert s.add_local(a) and s.add_local(b)
    chunks = s.schedule_prefill(32)
    assert [(x.request_id, len(c.token_ids), c.start) for x, c in chunks] == [("a", 32, 0)]  # cut: b waits
    s.on_prefill_done(chunks)
    assert [(x.request_id, len(c.token_ids), c.start) for x, c in s.schedule_prefill(32)] == [("a", 32, 32)]
    # No cap: the whole budget (a's remaining 68, then b's 20).
    assert [len(c.token_ids) for _, c in s.schedule_prefill()] == [68, 20]


def test_running_requests_get_a_step_between_chunks_and_outputs_equal_the_engine(demo_model_dir, reference_engine):
    cap = 16
    short, long_ = _prompt(1, 6), _prompt(2, 150)
    p_short = SamplingParams(max_tokens=40, **GREEDY)
    p_long = SamplingParams(max_tokens=8, **GREEDY)
    ref = reference_engine.generate([short, long_], [p_short, p_long])
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=8, num_blocks=64,
                       local_prefill_chunk_tokens=cap)
    worker = DecodeWorker("d0", cfg)
    tokens: dict[str, list[int]] = {}
    try:
        def collect():
            for b in worker.poll_token_batches(0.02):
                for d in b.deltas:
                    tokens.setdefault(d.request_id, []).extend(d.token_ids)

        def progressed():
            # The deadline restarts on every new token: this module runs in the test run's other stream
            # (nice 10: tests/stream_scheduling.py), where a live worker may get a tenth of a core for minutes.
            nonlocal deadline, seen
            if (n := sum(map(len, tokens.values()))) != seen:
                deadline, seen = time.monotonic() + 60, n
            return time.monotonic() < deadline

        assert worker.submit_local(GenerateRequest("short", tuple(short), p_short, 0, 0.0)) is not None
        deadline, seen = time.monotonic() + 60, None
        while len(tokens.get("short", [])) < 2:  # decoding now
            assert progressed()
            collect()
        assert worker.submit_local(GenerateRequest("long", tuple(long_), p_long, 0, 0.0)) is not None
        while len(tokens.get("long", [])) < p_long.max_tokens or len(tokens.get("short", [])) < 40:
            assert progressed(), tokens
            collect()
        assert tokens["short"] == list(ref[0].token_ids)
        assert tokens["long"] == list(ref[1].token_ids)
        # The long prompt went in chunks of at most `cap` tokens while "short" was decoding, and a
        # decode step was launched between any two of them.
        log = [entry for entry in worker.local_prefill.log if entry[2] > 0]
        assert sum(n for _, n, _ in log) == len(long_)
        assert all(n <= cap for _, n, _ in log) and len(log) == -(-len(long_) // cap)
        steps = [step for step, _, _ in log]
        assert all(b > a for a, b in zip(steps, steps[1:])), steps
        stats = worker.stats()
        assert stats.local_prefill_chunk_tokens == cap and stats.prefill_rate is not None
        assert stats.decode_rate is not None and stats.decode_rate.samples > 0
    finally:
        worker.shutdown()


def test_nothing_decoding_uses_the_whole_budget(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=4, num_blocks=32,
                       local_prefill_chunk_tokens=16)
    worker = DecodeWorker("d0", cfg)
    try:
        p = _prompt(3, 100)
        assert worker.submit_local(GenerateRequest("only", tuple(p), SamplingParams(max_tokens=2, **GREEDY), 0, 0.0)) is not None
        deadline = time.monotonic() + 60
        while not worker.local_prefill.log:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert worker.local_prefill.log[0][1:] == (100, 0)  # one pass: nobody was decoding
    finally:
        worker.shutdown()
