"""On the GPU: warm-up before serving (prefill shapes timed with CUDA events, the local-prefill path, a
decode step of every graph variant) and the local-prefill chunk cap with replayed graphs; greedy
outputs still equal the reference engine's on the same device."""

import time

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.wire.messages import GenerateRequest
from cluster.worker.pass_rate import DevicePassTimer, PassRateMeter
from cluster.sampling.sampling_params import SamplingParams
from cluster.worker.worker_config import WorkerConfig
from decode_worker.decode_worker import DecodeWorker
from prefill_worker.prefill_worker import PrefillWorker

pytestmark = pytest.mark.gpu
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_device_timer_reads_events_without_a_sync():
    meter = PassRateMeter()
    timer = DevicePassTimer(meter, "cuda")
    x = torch.randn(2048, 2048, device="cuda")
    for n in (1, 4, 16):
        start = timer.start()
        for _ in range(n):
            x = x @ x.T / 2048
        timer.stop(start, n)
    torch.cuda.synchronize()
    timer.harvest()
    rate = meter.rate()
    assert rate.samples == 3 and rate.unit_s > 0


def test_warmup_then_capped_local_prefill_equals_the_engine(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", device="cuda", num_blocks=512,
                       max_num_seqs=16, max_prefill_tokens=1024, local_prefill_chunk_tokens=64)
    worker = DecodeWorker("d0", cfg, capture_progress=False)
    try:
        info = worker.warmup()
        assert info["prefill_passes"] > 0 and info["requests"] == 5  # one under a grammar
        assert info["grammar_seconds"] > 0 and worker.grammars.compiles == 1
        stats = worker.stats()
        assert stats.prefill_rate is not None and stats.prefill_rate.samples >= info["prefill_passes"] // 2
        assert stats.decode_rate is not None and worker.graph_runner.num_captures > 0
        assert worker.poll_token_batches() == []  # warm-up published nothing
        short, long_ = [0, 5, 9, 17, 33, 2], [0] + [5 + (k * 13) % 400 for k in range(299)]
        p_short, p_long = SamplingParams(max_tokens=40, **GREEDY), SamplingParams(max_tokens=8, **GREEDY)
        ref = LLMEngine(demo_model_dir, dtype="float32", device="cuda").generate([short, long_], [p_short, p_long])
        tokens: dict[str, list[int]] = {}
        assert worker.submit_local(GenerateRequest("short", tuple(short), p_short, 0, 0.0)) is not None
        deadline = time.monotonic() + 60
        while len(tokens.get("short", [])) < 2:
            assert time.monotonic() < deadline
            for b in worker.poll_token_batches(0.01):
                for d in b.deltas:
                    tokens.setdefault(d.request_id, []).extend(d.token_ids)
        assert worker.submit_local(GenerateRequest("long", tuple(long_), p_long, 0, 0.0)) is not None
        while len(tokens.get("long", [])) < 8 or len(tokens.get("short", [])) < 40:
            assert time.monotonic() < deadline
            for b in worker.poll_token_batches(0.01):
                for d in b.deltas:
                    tokens.setdefault(d.request_id, []).extend(d.token_ids)
        assert tokens["short"] == list(ref[0].token_ids) and tokens["long"] == list(ref[1].token_ids)
        capped = [n for _, n, decoding in worker.local_prefill.log if decoding]
        assert capped and max(capped) <= 64 and sum(capped) == len(long_)
    finally:
        worker.shutdown()


def test_prefill_worker_warmup_seeds_its_rate(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", device="cuda", num_blocks=512,
                       max_prefill_tokens=2048)
    worker = PrefillWorker("p0", cfg).start()
    try:
        info = worker.warmup()
        rate = worker.stats().prefill_rate
        assert info["prefill_passes"] == 2 * info["shapes"] and rate is not None and rate.samples == info["shapes"]
        assert worker.allocator.num_free == worker.allocator.capacity
    finally:
        worker.shutdown()
