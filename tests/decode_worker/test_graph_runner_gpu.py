"""CUDA graphs on the GPU: replay equals eager for every bucket, no capture while serving, capture
time and memory reported."""

import random
import time

import pytest
import torch

from cluster.kv_cache import KVCacheSpec
from cluster.messages import GenerateRequest
from cluster.model.loader import load_model
from cluster.model_runner import ModelRunner, PrefillChunk
from cluster.sampling_params import SamplingParams
from cluster.sequence import Sequence
from cluster.worker_config import WorkerConfig
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeRow

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_graph_replay_equals_eager_for_every_bucket(demo_model_dir, backend):
    model = load_model(demo_model_dir, dtype="float32", device="cuda", attention_backend=backend)
    spec = KVCacheSpec.for_model(model.cfg, 16, 2048, torch.float32)
    runner = ModelRunner(model, spec, "cuda")
    graphs = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=32, max_blocks_per_seq=32, buckets="vllm")
    eager = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=32, max_blocks_per_seq=32, buckets="vllm",
                                use_cuda_graph=False)
    graphs.capture(progress=False)
    assert set(graphs.capture_stats) == set(graphs.buckets) == {1, 2, 4, 8, 16, 24, 32}
    assert all(s["seconds"] > 0 and s["bytes"] >= 0 for s in graphs.capture_stats.values())
    rng = random.Random(0)
    next_block = 1
    seqs = []
    for i in range(32):
        n = rng.randrange(1, 300)
        table = list(range(next_block, next_block + spec.blocks_for_tokens(n + 1)))
        next_block += len(table)
        prompt = [rng.randrange(5, 500) for _ in range(n)]
        runner.prefill([PrefillChunk(prompt, 0, table)])
        temp = 0.0 if i % 3 == 0 else 0.8
        s = Sequence(f"r{i}", prompt, SamplingParams(temperature=temp, top_p=0.9 if i % 3 == 2 else 1.0), seed=i)
        s.block_table = table
        seqs.append(s)
    kv0 = runner.kv_cache.clone()
    for n in sorted({b for b in graphs.buckets} | {b - 1 for b in graphs.buckets if b > 1}):
        for kind in ("greedy", "mixed"):
            chosen = seqs[:n] if kind == "mixed" else [s for s in seqs if s.params.greedy][:n]
            rows = [DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in chosen]
            runner.kv_cache.copy_(kv0)
            h = graphs.launch(rows)
            assert h.info.graph and h.info.bucket == graphs.padded_size(len(rows))
            got = h.tokens()
            kv_graph = runner.kv_cache.clone()
            runner.kv_cache.copy_(kv0)
            want = eager.launch(rows).tokens()
            assert got == want, f"batch {len(rows)} ({kind})"
            torch.testing.assert_close(kv_graph, runner.kv_cache)
    assert graphs.num_captures == len(graphs.buckets)  # one graph per bucket covers every sampling mode


def test_worker_serves_from_graphs_without_capturing(demo_model_dir, monkeypatch):
    from cluster.engine import LLMEngine
    from decode_worker.decode_worker import DecodeWorker

    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", device="cuda", attention_backend="triton",
                       num_blocks=1024, max_num_seqs=16)
    worker = DecodeWorker("g0", cfg)
    captured = worker.graph_runner.num_captures
    assert captured == len(worker.graph_runner.buckets)
    calls = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda *a, **k: calls.append(a))
    rng = random.Random(1)
    ps = [[0] + [rng.randrange(5, 500) for _ in range(n)] for n in (5, 90, 33, 200, 12, 64)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 8, 21, 15, 40, 3)]
    try:
        for i, (p, sp) in enumerate(zip(ps, params)):
            assert worker.submit_local(GenerateRequest(f"r{i}", tuple(p), sp, 0, 0.0))
        tokens, done, t0 = {}, set(), time.time()
        while len(done) < len(ps):
            assert time.time() - t0 < 60
            for b in worker.poll_token_batches(0.1):
                for d in b.deltas:
                    tokens.setdefault(d.request_id, []).extend(d.token_ids)
                    if d.finish_reason:
                        done.add(d.request_id)
        m = worker.step_metrics()
        assert m["graph_steps_total"] == m["steps_total"] > 0 and m["eager_steps_total"] == 0
        assert m["graphs_captured"] == captured and not calls
        assert m["capture_seconds"] > 0 and len(m["capture_stats"]) == len(worker.graph_runner.buckets)
        print(f"capture: {m['capture_seconds']:.2f}s, {m['capture_bytes'] / 2**20:.1f} MiB")
    finally:
        worker.shutdown()
    engine = LLMEngine(demo_model_dir, dtype="float32", device="cuda")
    ref = engine.generate(ps, params)
    for i, r in enumerate(ref):
        assert tokens[f"r{i}"] == list(r.token_ids)
