"""DecodeWorkerWarmup on CPU: the prefill shapes, the grammar engine and the synthetic requests (one
under a grammar) run through the serving path, publish nothing, leave every block free and every serving counter at zero, seed the measured
rates; and greedy outputs afterwards equal the reference engine's (the GPU variant:
test_warmup_gpu.py)."""

from __future__ import annotations

import time

import pytest

from cluster.engine.engine import LLMEngine
from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.warmup import WARMUP_PARAMS
from cluster.worker.worker_config import WorkerConfig
from decode_worker.decode_worker import DecodeWorker


def make_worker(model_dir, **kw):
    cfg = WorkerConfig(model_dir=str(model_dir), dtype="float32", max_num_seqs=8, num_blocks=128,
                       max_prefill_tokens=256, local_prefill_chunk_tokens=16, use_cuda_graph=False, **kw)
    return DecodeWorker("d0", cfg, capture_progress=False)


def test_warmup_runs_every_path_and_leaves_nothing_behind(demo_model_dir):
    worker = make_worker(demo_model_dir)
    try:
        info = worker.warmup()
        assert info["prefill_passes"] == 2 * info["shapes"] > 0  # every CPU shape fits this pool, twice
        assert info["requests"] == 2 + len(WARMUP_PARAMS) and info["seconds"] > 0  # one under a grammar
        assert 0 < info["grammar_seconds"] < info["seconds"] and worker.grammars.compiles == 1
        assert worker.warmup_info is info and worker.stats().extra["warmup"] == info
        assert worker.poll_token_batches(0.05) == []  # nothing was published
        st = worker.stats()
        assert st.prefill_rate is not None and st.prefill_rate.samples > 0  # seeded for the router
        assert st.decode_rate is not None  # decode steps ran
        assert st.free_blocks == st.total_blocks and st.running == st.waiting == 0
        worker.check_blocks()
        assert worker.step_metrics()["steps_total"] == 0 and worker.local_prefill.tokens_total == 0
        assert not worker.local_prefill.log and worker.blocks.allocator.stats.queries == 0
        # The worker serves as if the warm-up had not been: greedy output equals the engine's.
        prompt, p = [0, 5, 9, 17, 33, 2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ref = LLMEngine(demo_model_dir, dtype="float32").generate([prompt], p)[0]
        assert worker.submit_local(GenerateRequest("r", tuple(prompt), p, 0, 0.0)) is not None
        got, deadline = [], time.monotonic() + 60
        while len(got) < 6:
            assert time.monotonic() < deadline
            for b in worker.poll_token_batches(0.02):
                for d in b.deltas:
                    got.extend(d.token_ids)
        assert got == list(ref.token_ids)
    finally:
        worker.shutdown()


def test_warmup_refuses_a_serving_worker_and_cleans_up_after_a_timeout(demo_model_dir):
    worker = make_worker(demo_model_dir)
    try:
        with pytest.raises(TimeoutError):
            worker.warmup(timeout_s=0.0)
        assert not worker._warming  # the loop publishes again
        deadline = time.monotonic() + 30
        while worker.stats().running or worker.stats().waiting:  # the warm-up's requests run out
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        assert worker.submit_local(GenerateRequest("busy", (0, 5, 9), p, 0, 0.0)) is not None
        with pytest.raises(RuntimeError, match="before the worker serves"):
            worker.warmup()
    finally:
        worker.shutdown()
