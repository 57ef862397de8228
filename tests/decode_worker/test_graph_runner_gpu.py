"""CUDA graphs on the GPU: replay equals eager for every bucket, no capture while serving, capture
time and memory reported."""

import random
import time

import pytest
import torch

from cluster.kv.kv_cache import KVCacheSpec
from cluster.wire.messages import GenerateRequest
from cluster.model.loader import load_model
from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from cluster.worker.worker_config import WorkerConfig
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
    # The plain step at every bucket, the features variant at the coarser subset (cluster.engine.graph_buckets).
    assert set(graphs.capture_stats["plain"]) == set(graphs.buckets) == {1, 2, 4, 8, 16, 24, 32}
    assert set(graphs.capture_stats["features"]) == set(graphs.feature_buckets) == {1, 2, 4, 8, 16, 32}
    assert all(s["seconds"] > 0 and s["bytes"] >= 0 for per in graphs.capture_stats.values() for s in per.values())
    summary = graphs.capture_summary()
    assert summary["graphs"] == graphs.num_captures == 7 + 6 and summary["features_state_bytes"] > 0
    rng = random.Random(0)
    next_block = 1
    seqs, fseqs = [], []
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
        # The same prompt and blocks, every other one with penalties and logprobs: the features variant.
        f = Sequence(f"f{i}", prompt, SamplingParams(temperature=temp, presence_penalty=0.5, logprobs=2)
                     if i % 2 == 0 else s.params, seed=i)
        f.block_table = table
        fseqs.append(f)
    kv0 = runner.kv_cache.clone()
    for n in sorted({b for b in graphs.buckets} | {b - 1 for b in graphs.buckets if b > 1}):
        for kind in ("greedy", "mixed", "features"):
            chosen = {"mixed": seqs[:n], "features": fseqs[:n]}.get(kind) or [s for s in seqs if s.params.greedy][:n]
            rows = [DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in chosen]
            runner.kv_cache.copy_(kv0)
            h = graphs.launch(rows)
            features = kind == "features"
            assert h.info.graph and h.info.features == features
            assert h.info.bucket == graphs.padded_size(len(rows), features)
            assert h.info.bucket in (graphs.feature_buckets if features else graphs.buckets)
            got, got_lp = h.tokens(), h.logprobs()
            got_lp = None if got_lp is None else [a.copy() for a in got_lp]  # views of the runner's pinned slot
            kv_graph = runner.kv_cache.clone()
            runner.kv_cache.copy_(kv0)
            he = eager.launch(rows)
            want, want_lp = he.tokens(), he.logprobs()
            assert got == want, f"batch {len(rows)} ({kind})"
            if features:
                torch.testing.assert_close(torch.from_numpy(got_lp[0]), torch.from_numpy(want_lp[0].copy()),
                                           rtol=1e-4, atol=1e-4)
            # float32: the torch backend's eager step gathers only `width` blocks, the graph all of them,
            # so its sums run in another order (H200: 3 of 16M values off by 1.4e-5).
            torch.testing.assert_close(kv_graph, runner.kv_cache, rtol=1e-4, atol=1e-4)
    # One plain graph per bucket covers every sampling mode; one features graph per feature bucket.
    assert graphs.num_captures == len(graphs.buckets) + len(graphs.feature_buckets)


def test_worker_serves_from_graphs_without_capturing(demo_model_dir, monkeypatch):
    from cluster.engine.engine import LLMEngine
    from decode_worker.decode_worker import DecodeWorker

    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", device="cuda", attention_backend="triton",
                       num_blocks=1024, max_num_seqs=16)
    worker = DecodeWorker("g0", cfg)
    gr = worker.graph_runner
    captured = gr.num_captures
    assert captured == len(gr.buckets) + len(gr.feature_buckets)
    calls = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda *a, **k: calls.append(a))
    rng = random.Random(1)
    ps = [[0] + [rng.randrange(5, 500) for _ in range(n)] for n in (5, 90, 33, 200, 12, 64)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 8, 21, 15, 40, 3)]
    try:
        for i, (p, sp) in enumerate(zip(ps, params)):
            assert worker.submit_local(GenerateRequest(f"r{i}", tuple(p), sp, 0, 0.0)) is not None
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
        assert m["capture_seconds"] > 0 and m["capture"]["plain"]["graphs"] == len(gr.buckets)
        assert m["capture"]["features"]["graphs"] == len(gr.feature_buckets) == len(m["feature_graph_buckets"])
        print(f"capture: {m['capture_seconds']:.2f}s, {m['capture_bytes'] / 2**20:.1f} MiB")
    finally:
        worker.shutdown()
    engine = LLMEngine(demo_model_dir, dtype="float32", device="cuda")
    ref = engine.generate(ps, params)
    for i, r in enumerate(ref):
        assert tokens[f"r{i}"] == list(r.token_ids)


def _graph_kernels(num_layers: int, bucket: int) -> dict[str, int]:
    """Node counts of one captured decode step of a random bf16 model with Llama-3.2-1B's layer shape."""
    from cluster.model.config import ModelArchConfig
    from cluster.model.loader import random_model

    arch = ModelArchConfig.from_dict(dict(
        model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=4096, tie_word_embeddings=True))
    model = random_model(arch, torch.bfloat16, "cuda", attention_backend="triton")
    spec = KVCacheSpec.for_model(arch, 16, 256, torch.bfloat16)
    runner = ModelRunner(model, spec, "cuda")
    graphs = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=bucket, max_blocks_per_seq=16,
                                 buckets=(bucket,), keep_graphs=True)
    graphs.capture(progress=False)
    return graphs.kernels_per_step(bucket)


@pytest.mark.parametrize("bucket", [1, 64])
def test_a_decode_layer_is_at_most_12_kernels(bucket):
    """Counted in the captured graphs themselves: a 4-layer model's step less a 2-layer model's, over 2
    (what is per step, not per layer, cancels out)."""
    two, four = _graph_kernels(2, bucket), _graph_kernels(4, bucket)
    per_layer = (four["kernel"] - two["kernel"]) / 2
    print(f"bucket {bucket}: {four}, {per_layer:.1f} kernels per layer, {two['kernel'] - 2 * per_layer:.0f} per step")
    assert per_layer <= 12, (two, four)
    assert four.get("memcpy", 0) == 0, four  # inputs arrive by the one copy before replay


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(demo_model_dir):
    # float32: the sampler is bit-for-bit batch invariant, the matmuls (cuBLAS picks kernels by batch
    # size) and split-K attention only up to rounding, which in bfloat16 could flip a near tie.
    model = load_model(demo_model_dir, dtype="float32", device="cuda", attention_backend="triton")
    spec = KVCacheSpec.for_model(model.cfg, 16, 512, torch.float32)
    runner = ModelRunner(model, spec, "cuda")
    graphs = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=16, max_blocks_per_seq=16, buckets="vllm")
    graphs.capture(progress=False)
    rng = random.Random(3)
    seqs, next_block = [], 1
    for i in range(9):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randrange(5, 100))]
        table = list(range(next_block, next_block + spec.blocks_for_tokens(len(prompt) + 8)))
        next_block += len(table)
        runner.prefill([PrefillChunk(prompt, 0, table)])
        params = SamplingParams(temperature=1.0, top_p=0.95 if i % 2 else 1.0, top_k=40 if i % 3 == 0 else 0)
        s = Sequence(f"s{i}", prompt, params, seed=1000 + i)
        s.block_table = table
        seqs.append(s)
    kv0 = runner.kv_cache.clone()

    def decode(batch, steps=4):
        runner.kv_cache.copy_(kv0)
        out = {s.request_id: [] for s in batch}
        rows = [DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in batch]
        for step in range(steps):
            toks = graphs.launch(rows).tokens()
            for s, t in zip(batch, toks):
                out[s.request_id].append(t)
            rows = [DecodeRow(s, 0, i, s.num_tokens + step) for i, s in enumerate(batch)]
        return out

    together = decode(seqs)  # bucket 16
    for i in (0, 3, 8):
        alone = decode([seqs[i]])  # bucket 1
        assert alone[seqs[i].request_id] == together[seqs[i].request_id]
    reordered = decode(seqs[::-1][:5])  # bucket 8, other rows
    for s in seqs[::-1][:5]:
        assert reordered[s.request_id] == together[s.request_id]
