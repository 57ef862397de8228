"""Rules that several components apply must come from one function: first-token sampling, FCFS
prefill chunking, KV pool sizing and the graph-bucket rule. Each test runs every user of a rule on
the same input and demands the same answer, so a private copy that drifts fails here."""

from __future__ import annotations

import time
from collections import deque

import pytest
import torch

from cluster.chunked_prefill import fcfs_chunks
from cluster.engine import LLMEngine
from cluster.kv_cache import DeviceMemory, KVCacheSpec, kv_pool_blocks
from cluster.messages import GenerateRequest, WorkerStats
from cluster.model.config import ModelArchConfig
from cluster.sampling_params import SamplingParams
from cluster.sequence import Sequence, SequenceStatus
from cluster.worker_config import WorkerConfig
from decode_worker.block_manager import BlockManager
from decode_worker.decode_worker import DecodeWorker
from decode_worker.scheduler import DecodeScheduler

SAMPLED = [SamplingParams(max_tokens=1, temperature=0.9, seed=s, ignore_eos=True) for s in (11, 12)] + [
    SamplingParams(max_tokens=1, temperature=1.3, top_k=7, top_p=0.8, seed=13, ignore_eos=True),
    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]


def test_fcfs_chunks_rule():
    items = [("a", 10), ("b", 90), ("c", 5)]
    plan = fcfs_chunks(items, 40, lambda it: (list(range(it[1])), 0, [1]))
    assert [(it[0], c.start, len(c.token_ids)) for it, c in plan] == [("a", 0, 10), ("b", 0, 30)]  # cut: ends
    plan = fcfs_chunks(items, 200, lambda it: (list(range(it[1])), 0, [1]), admit=lambda it: it[0] != "b")
    assert [it[0] for it, _ in plan] == ["a"]  # b can't be admitted: nothing overtakes it


def test_every_prefill_scheduler_chunks_alike(demo_model_dir):
    """The engine, the decode worker's local prefill and the prefill worker plan the same passes."""
    from prefill_worker.prefill_worker import PrefillWorker, _Job

    lengths, budget = [10, 90, 33, 3], 40
    prompts = [list(range(5, 5 + n)) for n in lengths]

    def run(plan_once, advance):
        passes = []
        while True:
            plan = plan_once()
            if not plan:
                return passes
            passes.append([(c.start, len(c.token_ids)) for _, c in plan])
            advance(plan)

    engine = LLMEngine(demo_model_dir, num_blocks=64, max_prefill_tokens=budget)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]

    def engine_advance(plan):
        for s, c in plan:
            s.num_cached_tokens += len(c.token_ids)
            if s.num_cached_tokens == s.num_tokens:
                engine.waiting.remove(s)
    engine_passes = run(engine._schedule_prefill, engine_advance)

    sched = DecodeScheduler(BlockManager(64, 16), 8, budget, 4096)
    for i, p in enumerate(prompts):
        assert sched.add_local(Sequence(f"r{i}", p, SamplingParams(max_tokens=1), seed=0))

    def sched_advance(plan):
        for s in sched.on_prefill_done(plan):
            sched.waiting.remove(s)
    decode_passes = run(sched.schedule_prefill, sched_advance)

    pw = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), num_blocks=64, max_prefill_tokens=budget))
    for i, p in enumerate(prompts):
        req = GenerateRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=1), 0, 0.0)
        pw._waiting.append(_Job(type("T", (), {"request": req})(), None, time.perf_counter()))

    def prefill_advance(plan):
        for j, c in plan:
            j.done_tokens += len(c.token_ids)
            if j.done_tokens == len(j.prompt):
                pw._waiting.remove(j)
    prefill_passes = run(pw._schedule, prefill_advance)

    assert engine_passes == decode_passes == prefill_passes
    assert engine_passes[0] == [(0, 10), (0, 30)] and len(engine_passes) == 4


def test_first_token_is_the_same_on_every_path(demo_model_dir):
    """Seeded sampled (and filtered) first tokens: engine == prefill worker == decode worker's local prefill."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "transport"))
    import harness

    from cluster.transport.factory import TransportSpec, create_transport
    from prefill_worker.prefill_worker import PrefillWorker

    prompts = [list(range(7, 7 + n)) for n in (5, 40, 17, 9)]
    engine = LLMEngine(demo_model_dir, dtype="float32")
    ref = [o.token_ids[0] for o in engine.generate(prompts, SAMPLED)]
    assert len(set(ref)) > 1

    spec = TransportSpec("local", namespace="first-token", heartbeat_s=0.05)
    dec = harness.DecodeSide("d0", demo_model_dir, spec)
    pw = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", num_blocks=64))
    pw.set_transport(create_transport(spec, pw.kv_cache, "p0", "prefill"), send_timeout_s=5.0)
    pw.start()
    try:
        reqs = [GenerateRequest(f"r{i}", tuple(p), sp, sp.seed or 0, 0.0) for i, (p, sp) in enumerate(zip(prompts, SAMPLED))]
        results = [pw.submit(dec.reserve(r, "p0")).result(timeout=30) for r in reqs]
        assert [r.first_token for r in results] == ref
    finally:
        pw.shutdown()

    worker = DecodeWorker("d1", WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=8))
    try:
        for r in reqs:
            assert worker.submit_local(r) is not None
        got, deadline = {}, time.time() + 30
        while len(got) < len(reqs) and time.time() < deadline:
            for b in worker.poll_token_batches(0.05):
                for d in b.deltas:
                    got.setdefault(d.request_id, d.token_ids[0] if d.token_ids else None)
        assert [got[f"r{i}"] for i in range(len(reqs))] == ref
    finally:
        worker.shutdown()


def _arch() -> ModelArchConfig:
    return ModelArchConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                           max_position_embeddings=8192)


def test_kv_pool_sizing_rule():
    arch, gib = _arch(), 1 << 30
    cfg = WorkerConfig(model_dir="x", device="cuda", max_num_seqs=128, max_prefill_tokens=4096)
    per_block = KVCacheSpec.for_model(arch, 16, 1, torch.bfloat16).bytes_per_block
    whole = kv_pool_blocks(cfg, arch, torch.bfloat16, torch.device("cuda"),
                           DeviceMemory(total=140 * gib, free=124 * gib, reserved_here=16 * gib))
    assert 0.8 * 100 * gib / per_block < whole < 0.85 * 124 * gib / per_block
    # Two actors on one GPU, both starting while it is still empty: each takes its half, not all.
    half = WorkerConfig(model_dir="x", device="cuda", max_num_seqs=128, max_prefill_tokens=4096, gpu_share=0.5)
    shared = kv_pool_blocks(half, arch, torch.bfloat16, torch.device("cuda"),
                            DeviceMemory(total=140 * gib, free=124 * gib, reserved_here=16 * gib))
    assert 2 * shared < whole
    assert kv_pool_blocks(WorkerConfig(model_dir="x", num_blocks=7), arch, torch.bfloat16, torch.device("cuda")) == 7
    assert kv_pool_blocks(WorkerConfig(model_dir="x", cpu_num_blocks=33), arch, torch.bfloat16, torch.device("cpu")) == 33


def test_graph_bucket_rule_is_the_runners_and_the_routers(demo_model_dir):
    """The router's placement judges the padding a new request would cause on a decode worker by the
    buckets the worker reports (WorkerStats.graph_buckets: those its runner captured) and by the
    bucket rule of cluster.graph_buckets, which the runner pads every step by."""
    from cluster import graph_buckets
    from cluster.kv_cache import KVCacheSpec
    from cluster.model.loader import load_model
    from cluster.model_runner import ModelRunner
    from decode_worker import bucketed_graph_runner
    from decode_worker.bucketed_graph_runner import BucketedGraphRunner
    from decode_worker.scheduler import DecodeRow
    from router import placement
    from router.placement import LeastLoadedDecode, WorkerView

    # One function each, imported, not copied.
    assert placement.padding_fraction is graph_buckets.padding_fraction
    assert bucketed_graph_runner.padded_size is graph_buckets.padded_size
    assert bucketed_graph_runner.bucket_sizes is graph_buckets.bucket_sizes

    # The worker reports what its runner captured.
    worker = DecodeWorker("d0", WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", max_num_seqs=8,
                                             graph_buckets=(5, 3)))
    try:
        reported = worker.stats().graph_buckets
        assert reported == tuple(worker.graph_runner.buckets) == (3, 5)
    finally:
        worker.shutdown()

    # Every batch size: the rows the runner really computes == what placement reads off the reported buckets.
    model = load_model(demo_model_dir, dtype="float32")
    spec = KVCacheSpec.for_model(model.cfg, 16, 16, torch.float32)
    runner = ModelRunner(model, spec, "cpu")
    gr = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=8, max_blocks_per_seq=2, buckets=(5, 3))
    policy = LeastLoadedDecode()
    for n in range(1, 9):
        seqs = [Sequence(f"r{i}", [5, 6, 7], SamplingParams(temperature=0.0), seed=0) for i in range(n)]
        for i, s in enumerate(seqs):
            s.block_table = [1 + i]
        h = gr.launch([DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in seqs])
        h.tokens()
        computed = h.info.bucket
        assert computed == graph_buckets.padded_size(reported, n) == (3 if n <= 3 else 5 if n <= 5 else n)
        # Placement's tie-break for a worker running n - 1 requests (the new one makes n).
        v = WorkerView("d0", "decode", WorkerStats("d0", "decode", True, 100, 100, n - 1, graph_buckets=reported,
                                                   max_num_seqs=8))
        assert policy._key(v, 1)[1] == pytest.approx((computed - n) / computed)
