"""Rules that several components apply must come from one function: first-token sampling, FCFS
prefill chunking, KV pool sizing, the served context length, "does this request fit", the graph-bucket
rule, and the defaults a component shares with ClusterConfig. Each test runs every user of a rule on
the same input and demands the same answer, so a private copy that drifts fails here."""

from __future__ import annotations

import time
from collections import deque

import pytest
import torch

from cluster.engine.chunked_prefill import fcfs_chunks
from cluster.engine.engine import LLMEngine
from cluster.kv.kv_cache import DeviceMemory, KVCacheSpec, kv_pool_blocks
from cluster.wire.messages import GenerateRequest, WorkerStats
from cluster.model.config import ModelArchConfig
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.worker.worker_config import WorkerConfig
from decode_worker.block_manager import BlockManager
from decode_worker.decode_worker import DecodeWorker
from decode_worker.scheduler import DecodeScheduler
from python_source import parse

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
    from cluster.wire.messages import PrefillTask
    from prefill_worker.prefill_job import PrefillJob
    from prefill_worker.prefill_worker import PrefillWorker

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
        pw._waiting.append(PrefillJob(PrefillTask(req), None, time.perf_counter()))

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


def test_kv_pool_counts_the_decode_graphs_features_state(monkeypatch):
    """The features variant's state (per-slot tables, step outputs) is allocated by the decode graph
    runner after the pool: the sizing rule leaves room for it, measured from the allocators."""
    import cluster.sampling.sampler
    from cluster.sampling.sampler import features_state_bytes

    arch, gib = _arch(), 1 << 30
    cfg = WorkerConfig(model_dir="x", device="cuda", max_num_seqs=256, max_prefill_tokens=4096)
    mem = DeviceMemory(total=140 * gib, free=124 * gib, reserved_here=16 * gib)
    per_block = KVCacheSpec.for_model(arch, 16, 1, torch.bfloat16).bytes_per_block
    counted = kv_pool_blocks(cfg, arch, torch.bfloat16, torch.device("cuda"), mem)
    monkeypatch.setattr(cluster.sampling.sampler, "features_state_bytes", lambda rows, vocab: 0)
    uncounted = kv_pool_blocks(cfg, arch, torch.bfloat16, torch.device("cuda"), mem)
    state = features_state_bytes(256, arch.vocab_size)
    assert 8 * 256 * arch.vocab_size <= state < 9 * 256 * arch.vocab_size  # counts + processed logits + ...
    assert abs((uncounted - counted) - state * cfg.kv_memory_fraction / per_block) <= 1


# -- the served context length and "does this request fit" (cluster.kv.request_limits) ---------------
def test_served_max_model_len_is_one_rule(demo_model_dir):
    """The decode worker, the prefill worker and the engine serve the context length the rule gives
    (the launcher's, which the router admits with, is the same call: no other module clamps)."""
    from cluster.kv.request_limits import served_max_model_len
    from prefill_worker.prefill_worker import PrefillWorker

    arch = ModelArchConfig.from_dir(demo_model_dir)
    mpe = arch.max_position_embeddings
    for configured in (None, 300, mpe + 1000):
        cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=16, max_model_len=configured,
                           use_cuda_graph=False, max_num_seqs=4)
        want = served_max_model_len(configured, mpe)
        assert PrefillWorker("p0", cfg).max_model_len == want
        d = DecodeWorker("d0", cfg, capture_progress=False, start=False)
        assert d.max_model_len == want and d.scheduler.max_model_len == want
        d.shutdown()
    assert LLMEngine(demo_model_dir, num_blocks=16).max_model_len == served_max_model_len(None, mpe)


def test_no_module_clamps_the_context_length_itself():
    """A private `min(... max_position_embeddings ...)` anywhere in the serving code is a second copy."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for top in ("cluster", "prefill_worker", "decode_worker", "router", "deploy"):
        for path in (root / top).rglob("*.py"):
            if path.relative_to(root).as_posix() == "cluster/kv/request_limits.py":
                continue
            src = path.read_text()
            for node in ast.walk(parse(src, str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max")
                        and "max_position_embeddings" in ast.get_source_segment(src, node)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def _verdict(fn) -> str | None:
    """None if `fn()` accepts the request, else the 400's param."""
    from cluster.errors import InvalidRequestError

    try:
        fn()
    except InvalidRequestError as e:
        return e.param
    return None


@pytest.mark.parametrize("max_model_len,num_blocks", [(4096, 9), (200, 64)], ids=["kv-bound", "context-bound"])
def test_request_fit_is_one_rule(demo_model_dir, max_model_len, num_blocks):
    """Admission (against the largest decode worker), the decode worker, the engine and the prefill
    worker (the prompt alone) accept and refuse the same requests as cluster.kv.request_limits says, at
    the edges of the context length and of the KV pool."""
    from cluster.wire.messages import PrefillTask, Reservation, WorkerStats
    from cluster.kv.request_limits import check_request_fits
    from prefill_worker.prefill_worker import PrefillWorker
    from router.requests.admission import AdmissionController, AdmissionLimits
    from router.placement.placement import WorkerView

    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=num_blocks, max_model_len=max_model_len,
                       use_cuda_graph=False, max_num_seqs=4)
    decode = DecodeWorker("d0", cfg, capture_progress=False, start=False)
    prefill = PrefillWorker("p0", cfg)
    engine = LLMEngine(demo_model_dir, num_blocks=num_blocks)
    bs, cap = cfg.block_size, decode.blocks.capacity
    assert prefill.allocator.capacity == engine.allocator.capacity == cap
    view = WorkerView("d0", "decode", WorkerStats("d0", "decode", True, cap, cap, 0))
    view.healthy = True
    admission = AdmissionController(AdmissionLimits(max_model_len=decode.max_model_len, block_size=bs))
    edge = min(decode.max_model_len, cap * bs)
    # (prompt, max_tokens) at each edge; a prompt of `edge` tokens fits a prefill worker alone.
    cases = [(edge - 10, 10), (edge - 10, 11), (edge - 1, 1), (edge, 1), (edge + 1, 1), (10, 5)]
    try:
        for i, (n, m) in enumerate(cases):
            ids = [(5 + k) % 500 for k in range(n)]
            params = SamplingParams(max_tokens=m)
            rule = _verdict(lambda: check_request_fits(n, m, decode.max_model_len, block_size=bs, kv_blocks=cap))
            assert _verdict(lambda: admission.admit(f"a{i}", n, m, [view])) == rule, (n, m)
            req = GenerateRequest(f"r{i}", tuple(ids), params, 0, 0.0)
            assert _verdict(lambda: decode.sequences.build(req)) == rule, (n, m)
            if engine.max_model_len == decode.max_model_len:
                assert _verdict(lambda: engine.add_request(ids, params)) == rule, (n, m)
            prompt_rule = _verdict(lambda: check_request_fits(n, 0, decode.max_model_len, block_size=bs, kv_blocks=cap))
            fut = prefill.submit(PrefillTask(req, Reservation(req.request_id, "d0", (), 0)))
            assert (fut.done() and not fut.result().ok) == (prompt_rule is not None), (n, m)
            admission.release(f"a{i}")
    finally:
        decode.shutdown()


# -- defaults a component shares with ClusterConfig (deploy/config.py) -----------------------------
def _defaults(component) -> dict:
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(component) if f.default is not dataclasses.MISSING}


def test_cluster_config_takes_every_shared_default_from_its_component():
    """Every ClusterConfig setting a component also has is either taken from the component's config
    (same default) or a declared deployment choice (another default, on purpose)."""
    import dataclasses

    from deploy.config import COMPONENT_DEFAULTS, DEPLOY_CHOICES, ClusterConfig
    from router.requests.admission import AdmissionLimits
    from router.openai.gateway_config import GatewayConfig
    from router.placement.pd_planner import PlannerConfig
    from router.router_config import RouterConfig

    fields = ClusterConfig.model_fields
    for name, (component, cname) in COMPONENT_DEFAULTS.items():
        assert fields[name].default == _defaults(component)[cname], (name, component.__name__)
    for name, (component, cname, why) in DEPLOY_CHOICES.items():
        assert name in fields and cname in _defaults(component) and why, name
        assert name not in COMPONENT_DEFAULTS
    # A component setting ClusterConfig repeats under the same name must be one of the two.
    components = (WorkerConfig, RouterConfig, AdmissionLimits, GatewayConfig, PlannerConfig)
    same_name = {n for c in components for n in _defaults(c) if n in fields}
    declared = set(COMPONENT_DEFAULTS) | set(DEPLOY_CHOICES)
    assert same_name <= declared, same_name - declared
    assert {f.name for f in dataclasses.fields(WorkerConfig)} - declared == {"model_dir", "gpu_share",
                                                                              "cluster_secret"}  # the launcher's


def test_default_cluster_config_builds_each_component_with_its_own_defaults():
    """The mapping (deploy/component_configs.py) carries values and decides none: from a default
    ClusterConfig every component gets its own defaults, except the declared deployment choices."""
    from dataclasses import replace

    from deploy.api_server import APIServerSpec
    from deploy.component_configs import admission_limits, api_server_settings, router_config, worker_config
    from deploy.config import ClusterConfig
    from router.requests.admission import AdmissionLimits
    from router.openai.gateway_config import GatewayConfig
    from router.router_config import RouterConfig

    cfg = ClusterConfig()
    assert worker_config(cfg, "/m", "cpu") == WorkerConfig(model_dir="/m")
    assert router_config(cfg) == replace(RouterConfig(), worker_max_restarts=3)
    assert admission_limits(cfg, 512) == AdmissionLimits(max_model_len=512, block_size=16, max_prefill_queue_s=5.0)
    spec = APIServerSpec(index=0, listen_fd=3, parent_pid=1, **api_server_settings(
        cfg, router_address="ipc://r", model_dir="/m", served_model_name="m", max_model_len=512, sink_host="h",
        log_level="INFO"))
    gateway = GatewayConfig(model_name="m", max_model_len=512)
    assert (spec.api_key, spec.max_body_bytes, spec.token_timeout_s, spec.tool_call_parser,
            spec.enable_auto_tool_choice) == (gateway.api_key, gateway.max_body_bytes, gateway.token_timeout_s,
                                              gateway.tool_call_parser, gateway.enable_auto_tool_choice)
    tools = ClusterConfig(tool_call_parser="llama3_json", enable_auto_tool_choice=True)
    settings = api_server_settings(tools, router_address="ipc://r", model_dir="/m", served_model_name="m",
                                   max_model_len=512, sink_host="h", log_level="INFO")
    assert (settings["tool_call_parser"], settings["enable_auto_tool_choice"]) == ("llama3_json", True)


def test_graph_bucket_rule_is_the_runners_and_the_routers(demo_model_dir):
    """The router's placement judges the padding a new request would cause on a decode worker by the
    buckets the worker reports (WorkerStats.graph_buckets: those its runner captured) and by the
    bucket rule of cluster.engine.graph_buckets, which the runner pads every step by."""
    from cluster.engine import graph_buckets
    from cluster.kv.kv_cache import KVCacheSpec
    from cluster.model.loader import load_model
    from cluster.engine.model_runner import ModelRunner
    from decode_worker import bucketed_graph_runner
    from decode_worker.bucketed_graph_runner import BucketedGraphRunner
    from decode_worker.scheduler import DecodeRow
    from router.placement import placement
    from router.placement.placement import LeastLoadedDecode, WorkerView

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
