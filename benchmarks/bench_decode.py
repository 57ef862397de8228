"""Decode-step benchmark on one GPU: the default path (CUDA graphs over the fused kernels) vs eager
vs Hugging Face generate.

Random bf16 weights with the shapes of Llama-3.2-1B and Llama-3.1-8B (built on the GPU from a config,
nothing downloaded), prompts of 512 tokens, batch sizes 1..256. Per (model, batch, mode) it records
the step time and the memory floor: the bytes a step reads (benchmarks.common.step_read_bytes: every
weight once but of the embedding table only the rows looked up, the KV of every row's context) over
the device-to-device copy bandwidth measured in the same run. `step_ms` is the loop's rate over the timed window (a median of
per-step walls misreads a host-bound loop such as eager's; `step_ms_median` keeps it), `gpu_step_ms`
the median CUDA-event time, `clocks` the SM clock and power while the row ran (nvidia-smi). Graph rows
(`mode: "graph"`, the default serving path) carry `kernels_per_step`: the kernel nodes of that
bucket's captured graph (and `features_kernels_per_step`, the features variant's). Also: padding waste
per bucket policy, capture time and memory per variant and bucket, kernel launches and device time per
kernel name from torch.profiler (`launches`; at the largest batch the kernels whose time differs most
between graph and eager: `graph_vs_eager_kernels`), the cost of sampled and top-k/top-p batches
against greedy ones, a mixed batch with penalties and logprobs (`mode: "graph-features"`, every other
row; `features_overhead` is its step time over the plain graph row's), host time per step (schedule +
prepare + launch + process + publish) and how much the overlap hides, optionally the same step through
torch.compile, and `checks`: issue 28's targets with their measured ratios (met / missed).

Rows carry `source: "bench_decode"`; the file keeps other benchmarks' rows (bench_fp8's) as they are.

The step loop is the decode worker's own (DecodeScheduler + BucketedGraphRunner, step t+1 launched
before step t's tokens are read), driven here without the worker's thread so that overlap can be
switched off for comparison.

    python -m benchmarks.bench_decode [--quick] [--out loadtest/results/decode_h200.json]
    python -m benchmarks.bench_decode --dry-run --out /tmp/decode.json   # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.engine.graph_buckets import bucket_sizes, feature_bucket_sizes, padding_waste
from cluster.kv.kv_cache import KVCacheSpec
from cluster.wire.messages import TokenBatch
from cluster.model.loader import random_model
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeScheduler

from benchmarks.common import (BLOCK_SIZE, SHAPES, arch_of, copy_bandwidth_gbps, hf_config_dict, log, median,
                               memory_floor_ms, step_read_bytes, sync)


def msgpack_encode(batch) -> bytes:
    """A step's deltas in their wire format (cluster/wire/stream_messages.py), as the publisher thread
    sends them to a gateway; its detokenization (no tokenizer here) is not part of this timing."""
    from cluster.wire.stream_messages import StreamBatch, StreamDelta, encode

    return encode(StreamBatch(batch.worker_id, batch.step, tuple(
        StreamDelta(d.request_id, d.token_ids, "", d.finish_reason, d.error) for d in batch.deltas)))


SOURCE = "bench_decode"  # the `source` of this script's rows (bench_fp8 merges its own into the same file)
PROMPT_LEN = 512
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MAX_NUM_SEQS = 256
MAX_MODEL_LEN = 1024

# Sampling parameters of the three kinds of batch the sampler handles (one graph serves all).
SAMPLING = {"greedy": dict(temperature=0.0), "sample": dict(temperature=0.8),
            "filtered": dict(temperature=0.8, top_k=50, top_p=0.9)}
# `mode: "graph-features"`: a mixed batch, every other row with penalties and logprobs (the decode
# graph's features variant runs for the whole batch), the others plain sampling.
FEATURES = dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logprobs=5)


def row_params(sampling: str, i: int) -> dict:
    if sampling == "features":
        return FEATURES if i % 2 == 0 else SAMPLING["sample"]
    return SAMPLING[sampling]


# -- the decode loop under test ------------------------------------------------------------------
@dataclass
class LoopTiming:
    """One timed run of the loop: `step_ms` is the rate (the interval from the first measured step's
    end to the last one's, over the steps between), not a median of per-step walls, which a host-bound
    loop (eager) makes irregular; `median_ms` is that median, for comparison."""

    step_ms: float
    median_ms: float
    gpu_ms: float  # median device time per step (CUDA events; wall on CPU)
    host_us: float  # median host time per step on the loop thread (schedule + prepare + launch + process)
    steps: int
    clocks: dict | None = None  # SM clock and power while it ran (nvidia-smi), when available


class ClockSampler:
    """SM clock and board power sampled by `nvidia-smi` every 0.1 s while a block runs (a step that
    runs slower under sustained load is throttled, not worse code). None without nvidia-smi."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float, float]] = []

    def __enter__(self):
        if self.enabled:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=clocks.sm,power.draw",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=2)
                mhz, watts = (float(x) for x in out.stdout.strip().splitlines()[0].split(","))
                self.samples.append((mhz, watts))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.1)

    def __exit__(self, *exc):
        if self.enabled:
            self._stop.set()
            self._thread.join(timeout=3)

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        return {"sm_mhz": median([m for m, _ in self.samples]), "power_w": median([w for _, w in self.samples]),
                "samples": len(self.samples)}


class Bench:
    def __init__(self, name: str, kv_blocks: int, buckets, device: str = "cuda"):
        self.name = name
        self.device = device
        self.arch = arch_of(name)
        torch.manual_seed(0)
        # Triton attention on the GPU; on CPU (--dry-run) the torch reference, Triton having no CPU backend.
        backend = "triton" if device == "cuda" else "torch"
        self.model = random_model(self.arch, torch.bfloat16, device, attention_backend=backend)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.spec = KVCacheSpec.for_model(self.arch, BLOCK_SIZE, kv_blocks, torch.bfloat16)
        # Random KV (never time on zeros); every row attends over its own 512 prompt tokens.
        self.kv_cache = torch.empty(self.spec.shape, dtype=torch.bfloat16, device=device).normal_()
        self.model.bind_kv_cache(self.kv_cache)
        self.kw = dict(block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, max_blocks_per_seq=MAX_MODEL_LEN // BLOCK_SIZE)
        self.graph = BucketedGraphRunner(self.model, self.kv_cache, buckets=buckets, keep_graphs=True, **self.kw)
        self.eager = BucketedGraphRunner(self.model, self.kv_cache, buckets=buckets, use_cuda_graph=False, **self.kw)
        self.parts: dict[str, list[float]] = {}

    def bytes_per_step(self, bs: int) -> int:
        """What a step of `bs` rows reads (benchmarks.common.step_read_bytes, bench_fp8's floor too)."""
        return step_read_bytes(self.model, self.arch, bs, PROMPT_LEN, torch.bfloat16)

    def floor_ms(self, bs: int, copy_gbps: float) -> float:
        return memory_floor_ms(self.bytes_per_step(bs), copy_gbps)

    def new_scheduler(self, bs: int, sampling: str) -> DecodeScheduler:
        """`bs` running requests of one of the SAMPLING kinds (or "features"), 512 prompt tokens each."""
        if sampling not in SAMPLING and sampling != "features":
            raise ValueError(f"unknown sampling kind {sampling!r}: one of {sorted(SAMPLING)} or 'features'")
        sched = DecodeScheduler(BlockManager(self.spec.num_blocks, BLOCK_SIZE), MAX_NUM_SEQS, 4096, MAX_MODEL_LEN)
        for i in range(bs):
            params = SamplingParams(max_tokens=10_000, ignore_eos=True, **row_params(sampling, i))
            # Varied prompt tokens: the penalties see a real token history.
            s = Sequence(f"r{i}", [(7 * k + i) % self.arch.vocab_size for k in range(PROMPT_LEN)], params, seed=i,
                         eos_token_ids=self.arch.eos_token_ids)
            assert sched.reserve(s) is not None
            sched.on_arrival(s.request_id, 7, ok=True)
        return sched

    def run_loop(self, runner: BucketedGraphRunner, bs: int, steps: int, overlap: bool,
                 sampling: str = "greedy") -> LoopTiming:
        """The worker's loop body, `steps` steps (the first few are warm-up, not timed)."""
        sched = self.new_scheduler(bs, sampling)
        inflight = None
        ends, gpus, hosts = [], [], []
        self.parts = {"prepare": [], "launch": [], "process": [], "encode": []}
        step = 0
        with ClockSampler(self.device == "cuda") as clocks:
            while step < steps or inflight is not None:
                t0 = time.perf_counter()
                launched = None
                if step < steps:
                    batch = sched.schedule_decode(step, pipeline_busy=inflight is not None)
                    handle = runner.launch(batch.rows)
                    sched.on_step_launched(batch)
                    launched = (batch, handle, time.perf_counter() - t0)
                    step += 1
                if not overlap and launched is not None:
                    pending = [launched]
                    launched = None
                else:
                    pending = [inflight] if inflight is not None else []
                for b, h, host_pre in pending:
                    toks = h.tokens()  # waits for that step only
                    t1 = time.perf_counter()
                    deltas = sched.on_step_output(b, toks, h.logprobs())
                    tb = TokenBatch("bench", b.step, tuple(deltas))  # what the loop thread hands the publisher
                    t2 = time.perf_counter()
                    msgpack_encode(tb)  # done on the publisher thread in the worker, timed apart
                    self.parts["encode"].append(time.perf_counter() - t2)
                    self.parts["process"].append(t2 - t1)
                    self.parts["prepare"].append(h.info.host_prepare_s)
                    self.parts["launch"].append(h.info.launch_s)
                    hosts.append(host_pre + t2 - t1)
                    gpus.append(h.gpu_time_s)
                    ends.append(time.perf_counter())
                inflight = launched
        skip = min(5, len(ends) // 4)  # warm-up steps
        walls = [b - a for a, b in zip(ends[skip:], ends[skip + 1:])]
        rate = (ends[-1] - ends[skip]) / (len(ends) - 1 - skip) if len(ends) - 1 > skip else float("nan")
        return LoopTiming(rate * 1e3, median(walls) * 1e3, median(gpus[skip:]) * 1e3, median(hosts[skip:]) * 1e6,
                          len(ends) - skip, clocks.summary())


def profile_launches(bench: Bench, runner: BucketedGraphRunner, bs: int, steps: int = 3) -> dict:
    """One profiled run of `steps` launches of a greedy batch: kernels and launch calls per step, and
    device time per kernel name (the breakdown that tells a slower graph from a slower kernel)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.device == "cuda"
    sched = bench.new_scheduler(bs, "greedy")
    batch = sched.schedule_decode(0, False)
    runner.launch(batch.rows).tokens()
    sync(bench.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.launch(batch.rows).tokens()
        sync(bench.device)
    kernels = api = graph_launches = memcpy = 0
    kernel_us = 0.0
    by_name: dict[str, float] = {}
    for e in prof.events():
        dev = str(getattr(e, "device_type", ""))
        if dev.endswith("CUDA"):
            if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                memcpy += 1
            else:
                kernels += 1
                us = getattr(e, "device_time_total", 0.0) or 0.0
                kernel_us += us
                by_name[e.name] = by_name.get(e.name, 0.0) + us
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            api += 1
        elif e.name.startswith("cudaGraphLaunch"):
            graph_launches += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:40]
    return {"kernels_per_step": kernels / steps, "host_kernel_launch_calls": api / steps,
            "graph_launches": graph_launches / steps, "memcpy_per_step": memcpy / steps,
            "kernel_time_us": kernel_us / steps, "kernel_us_by_name": {k: v / steps for k, v in top}}


def kernel_diff(graph: dict, eager: dict, top: int = 12) -> list[dict]:
    """Kernels whose device time per step differs most between the graph and the eager profile."""
    names = set(graph.get("kernel_us_by_name", {})) | set(eager.get("kernel_us_by_name", {}))
    rows = [{"kernel": n[:120], "graph_us": graph["kernel_us_by_name"].get(n, 0.0),
             "eager_us": eager["kernel_us_by_name"].get(n, 0.0)} for n in names]
    for r in rows:
        r["graph_minus_eager_us"] = r["graph_us"] - r["eager_us"]
    return sorted(rows, key=lambda r: -abs(r["graph_minus_eager_us"]))[:top]


def compiled_runner(bench: Bench, buckets) -> BucketedGraphRunner:
    """The same runner with its step function through torch.compile (Inductor fuses whatever is left
    between the Triton kernels), captured the same way. For comparison only: serving has no compile."""
    runner = BucketedGraphRunner(bench.model, bench.kv_cache, buckets=buckets, **bench.kw)
    runner._forward = torch.compile(runner._forward, dynamic=True, fullgraph=False)
    return runner


# -- Hugging Face baseline -----------------------------------------------------------------------
def hf_model_from(bench: Bench, device: str = "cuda"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = hf_config_dict(bench.name)
    cfg.pop("architectures")
    cfg.pop("model_type")
    rope = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = dict(rope, rope_theta=cfg.pop("rope_theta"))
    cfg.pop("dtype")
    config = LlamaConfig(**cfg)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    a, ours = bench.arch, bench.model
    q, kv, inter = a.q_size, a.kv_size, a.intermediate_size
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed_tokens.weight)
        hf.model.norm.weight.copy_(ours.norm.weight)
        if not a.tie_word_embeddings:
            hf.lm_head.weight.copy_(ours.lm_head.weight)
        for L, M in zip(hf.model.layers, ours.layers):
            w = M.self_attn.qkv_proj.weight
            L.self_attn.q_proj.weight.copy_(w[:q])
            L.self_attn.k_proj.weight.copy_(w[q : q + kv])
            L.self_attn.v_proj.weight.copy_(w[q + kv :])
            L.self_attn.o_proj.weight.copy_(M.self_attn.o_proj.weight)
            gu = M.mlp.gate_up_proj.weight
            L.mlp.gate_proj.weight.copy_(gu[:inter])
            L.mlp.up_proj.weight.copy_(gu[inter:])
            L.mlp.down_proj.weight.copy_(M.mlp.down_proj.weight)
            L.input_layernorm.weight.copy_(M.input_layernorm.weight)
            L.post_attention_layernorm.weight.copy_(M.post_attention_layernorm.weight)
    return hf


def hf_step_ms(hf, bs: int, new_tokens: int) -> float:
    """Per decode step of generate(): (time for 2 + n tokens - time for 2 tokens) / n."""
    ids = torch.randint(10, 120000, (bs, PROMPT_LEN), device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(2)
    short, long = gen(2), gen(2 + new_tokens)
    return (long - short) / new_tokens * 1e3


# -- targets -------------------------------------------------------------------------------------
# Issue 28's decode targets: (model, batch) -> the graph step's most over the memory floor.
FLOOR_TARGETS = {("llama-8b-shape", 1): 1.15, ("llama-8b-shape", 64): 1.25, ("llama-1b-shape", 1): 1.6}
SAMPLING_TARGET = 1.10  # filtered (top-k/top-p) and features steps over greedy, device time
SAMPLING_TARGET_BATCHES = (64, 256)


def _check(value: float | None, target: float, **what) -> dict:
    return {**what, "value": None if value is None else round(value, 4), "target": f"<= {target:g}",
            "met": None if value is None else value <= target}


def target_checks(result: dict) -> dict:
    """Each target as {value, target, met}; met is None where the run has no data for it."""
    rows = [r for r in result["rows"] if r.get("source") == SOURCE]

    def row(model, bs, mode):
        return next((r for r in rows if r["model"] == model and r["batch_size"] == bs and r["mode"] == mode), None)

    checks = {}
    for (model, bs), target in FLOOR_TARGETS.items():
        g = row(model, bs, "graph")
        checks[f"{model}/bs{bs}/graph_over_floor"] = _check(g["step_ms"] / g["floor_ms"] if g else None, target)
    pairs = sorted({(r["model"], r["batch_size"]) for r in rows if r["mode"] == "graph"})
    per = {}
    for model, bs in pairs:
        g, e = row(model, bs, "graph"), row(model, bs, "eager")
        per[f"{model}/bs{bs}"] = _check(g["step_ms"] / e["step_ms"] if g and e else None, 1.0)
    checks["graph_over_eager"] = {"met": None if not per or any(c["met"] is None for c in per.values())
                                  else all(c["met"] for c in per.values()), "target": "<= 1 at every batch",
                                  "per_batch": per}
    variants = result.get("sampler_variants", [])
    for model in sorted({r["model"] for r in rows}):
        for bs in SAMPLING_TARGET_BATCHES:
            greedy = next((v["gpu_step_ms"] for v in variants if v["model"] == model and v["batch_size"] == bs
                           and v["variant"] == "greedy"), None)
            filt = next((v["gpu_step_ms"] for v in variants if v["model"] == model and v["batch_size"] == bs
                         and v["variant"] == "filtered"), None)
            feat = row(model, bs, "graph-features")
            checks[f"{model}/bs{bs}/filtered_over_greedy"] = _check(filt / greedy if filt and greedy else None,
                                                                    SAMPLING_TARGET)
            checks[f"{model}/bs{bs}/features_over_greedy"] = _check(
                feat["gpu_step_ms"] / greedy if feat and greedy else None, SAMPLING_TARGET)
    return checks


def merge_into(path: Path, result: dict) -> dict:
    """This run's rows replace this script's earlier rows in the results file; other benchmarks' rows
    (bench_fp8's, tagged `source`) and their top-level keys are kept."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = [r for r in old.get("rows", []) if r.get("source") not in (SOURCE, None)]
    merged = {k: v for k, v in old.items() if k not in result}
    merged.update(result)
    merged["rows"] = kept + result["rows"]
    return merged


def summary_lines(result: dict) -> list[str]:
    lines = ["", "decode summary (ms per step; graph/eager = rate over the timed window)",
             f"{'model':15s} {'bs':>4s} {'floor':>7s} {'graph':>7s} {'x floor':>7s} {'eager':>7s} {'g/e':>5s} "
             f"{'feat':>7s} {'kernels':>7s}"]
    rows = [r for r in result["rows"] if r.get("source") == SOURCE]
    for model in sorted({r["model"] for r in rows}):
        for bs in sorted({r["batch_size"] for r in rows if r["model"] == model}):
            get = {r["mode"]: r for r in rows if r["model"] == model and r["batch_size"] == bs}
            g, e, f = get.get("graph"), get.get("eager"), get.get("graph-features")
            if g is None:
                continue
            lines.append(f"{model:15s} {bs:4d} {g['floor_ms']:7.3f} {g['step_ms']:7.3f} {g['step_ms'] / g['floor_ms']:7.2f} "
                         + (f"{e['step_ms']:7.3f} {g['step_ms'] / e['step_ms']:5.2f} " if e else f"{'-':>7s} {'-':>5s} ")
                         + (f"{f['step_ms']:7.3f} " if f else f"{'-':>7s} ") + f"{g.get('kernels_per_step') or '-':>7}")
    lines.append("checks: " + ", ".join(f"{k}={v['met']}" for k, v in result.get("checks", {}).items()))
    return lines


# -- main ----------------------------------------------------------------------------------------
def _timing_fields(t: LoopTiming) -> dict:
    return {"step_ms": t.step_ms, "step_ms_median": t.median_ms, "gpu_step_ms": t.gpu_ms, "host_us": t.host_us,
            "timed_steps": t.steps, "clocks": t.clocks}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1B shape only, batch 1 and 64, fewer steps")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, batch 1 and 4: checks the script")
    ap.add_argument("--out", default="loadtest/results/decode_h200.json")
    ap.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--batch-sizes", default=None, help="comma-separated, default " + ",".join(map(str, BATCH_SIZES)))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd step (batch 1 and 64)")
    ap.add_argument("--compile-models", default=None, help="only for these models (comma-separated)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-batch-sizes", default=None, help="HF generate only at these batch sizes")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    assert args.dry_run or torch.cuda.is_available(), "the decode benchmark needs a GPU (or --dry-run)"
    # 8B first: the optional compile measurement (1B) then runs last, after everything else is saved.
    if args.models:
        models = args.models.split(",")
    elif args.dry_run:
        models = ["tiny-shape"]
    else:
        models = ["llama-1b-shape"] if args.quick else ["llama-8b-shape", "llama-1b-shape"]
    if args.batch_sizes:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    else:
        batch_sizes = [1, 4] if args.dry_run else [1, 64] if args.quick else BATCH_SIZES
    steps = args.steps or (8 if args.dry_run else 30 if args.quick else 40)
    hf_sizes = batch_sizes if args.hf_batch_sizes is None else [int(b) for b in args.hf_batch_sizes.split(",")]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    copy_gbps = copy_bandwidth_gbps(device)
    log(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
        "command": " ".join(sys.argv), "prompt_len": PROMPT_LEN, "copy_GBps": copy_gbps, "rows": [], "capture": {},
        "launches": {}, "graph_vs_eager_kernels": {}, "host": [], "sampler_variants": [], "compile": [],
        "errors": [], "padding_waste": {p: padding_waste(bucket_sizes(p, MAX_NUM_SEQS), range(1, MAX_NUM_SEQS + 1))
                                        for p in ("vllm", "pow2")},
        "step_timing": "step_ms: the loop's rate over the timed window (first measured step's end to the last's); "
                       "step_ms_median: median per-step wall; gpu_step_ms: median CUDA-event time per step",
    }
    result["padding_waste"]["bench_sizes_only"] = padding_waste(BATCH_SIZES, range(1, MAX_NUM_SEQS + 1))
    result["padding_waste"]["features_variant"] = padding_waste(
        feature_bucket_sizes(bucket_sizes("vllm", MAX_NUM_SEQS)), range(1, MAX_NUM_SEQS + 1))

    def save():
        result["checks"] = target_checks(result)
        result["seconds"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps(merge_into(out_path, result), indent=1))

    for name in models:
        t_model = time.perf_counter()
        kv_blocks = max(batch_sizes) * ((PROMPT_LEN + steps + 16) // BLOCK_SIZE + 1) + 2
        bench = Bench(name, kv_blocks, buckets="vllm", device=device)
        log(f"{name}: {bench.weight_bytes / 1e9:.2f} GB of weights, KV pool {kv_blocks} blocks")
        bench.graph.capture(progress=False)
        result["capture"][name] = {"policy": "vllm", "max_num_seqs": MAX_NUM_SEQS, **bench.graph.capture_summary()}
        log(f"  captured {bench.graph.num_captures} graphs ({len(bench.graph.buckets)} plain, "
            f"{len(bench.graph.feature_buckets)} features) in {bench.graph.capture_seconds:.1f}s, "
            f"{bench.graph.capture_bytes / 2**20:.0f} MiB; features state {bench.graph.features_state_bytes / 2**20:.0f} MiB")
        captures_before = bench.graph.num_captures
        for bs in batch_sizes:
            floor_ms = bench.floor_ms(bs, copy_gbps)
            for mode, runner in (("graph", bench.graph), ("eager", bench.eager)):
                try:
                    t = bench.run_loop(runner, bs, steps if mode == "graph" else max(6, steps // 2), overlap=True)
                    row = {"source": SOURCE, "model": name, "batch_size": bs, "mode": mode, **_timing_fields(t),
                           "floor_ms": floor_ms, "floor_fraction": floor_ms / t.step_ms,
                           "bytes_per_step": bench.bytes_per_step(bs), "tokens_per_s": bs / (t.step_ms / 1e3)}
                    if mode == "graph":
                        b = runner.padded_size(bs)
                        nodes = runner.kernels_per_step(b) if b in runner.graphs else {}
                        row["bucket"] = b
                        row["kernels_per_step"] = nodes.get("kernel")
                        row["kernels_per_layer"] = ((nodes["kernel"] - 6) / bench.arch.num_layers
                                                    if "kernel" in nodes else None)
                        row["graph_nodes"] = nodes
                        fb = runner.padded_size(bs, features=True)
                        if fb in runner.feature_graphs:
                            row["features_kernels_per_step"] = runner.kernels_per_step(fb, features=True).get("kernel")
                    result["rows"].append(row)
                    log(f"  bs={bs:3d} {mode:5s} step {t.step_ms:7.3f} ms (median {t.median_ms:.3f}, gpu {t.gpu_ms:.3f}, "
                        f"floor {floor_ms:.3f}, {row['floor_fraction']:.0%}) host {t.host_us:.0f} us"
                        + (f", {row['kernels_per_step']} kernels" if mode == "graph" else "")
                        + (f", {t.clocks['sm_mhz']:.0f} MHz {t.clocks['power_w']:.0f} W" if t.clocks else ""))
                    if mode == "graph":
                        ts = bench.run_loop(runner, bs, max(6, steps // 2), overlap=False)
                        result["host"].append({
                            "model": name, "batch_size": bs, "host_us": t.host_us,
                            "step_ms_overlap": t.step_ms, "step_ms_no_overlap": ts.step_ms, "gpu_step_ms": t.gpu_ms,
                            "exposed_host_us_no_overlap": (ts.step_ms - ts.gpu_ms) * 1e3,
                            "exposed_host_us_overlap": max(0.0, t.step_ms - t.gpu_ms) * 1e3,
                            **{f"{k}_us": median(v) * 1e6 for k, v in bench.parts.items()},
                        })
                        log("      host parts (no-overlap run): " + ", ".join(
                            f"{k} {median(v) * 1e6:.0f} us" for k, v in bench.parts.items()))
                except Exception as e:  # noqa: BLE001 - keep the other measurements
                    traceback.print_exc()
                    result["errors"].append(f"{name} bs={bs} {mode}: {e!r}")
            save()
        result["capture"][name]["captures_while_serving"] = bench.graph.num_captures - captures_before
        # Launches and device time per kernel, graph and eager; at the largest batch their difference.
        for bs in sorted({b for b in (1, 64, max(batch_sizes)) if b in batch_sizes}):
            prof = {}
            for mode, runner in (("graph", bench.graph), ("eager", bench.eager)):
                try:
                    prof[mode] = result["launches"][f"{name}/bs{bs}/{mode}"] = profile_launches(bench, runner, bs)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    result["errors"].append(f"profile {name} {bs} {mode}: {e!r}")
            if bs == max(batch_sizes) and len(prof) == 2:
                result["graph_vs_eager_kernels"][f"{name}/bs{bs}"] = {
                    "graph_kernel_us": prof["graph"]["kernel_time_us"], "eager_kernel_us": prof["eager"]["kernel_time_us"],
                    "top_differences": kernel_diff(prof["graph"], prof["eager"])}
        for bs in [b for b in (1, 4, 64, 256) if b in batch_sizes]:
            for kind in SAMPLING:
                t = bench.run_loop(bench.graph, bs, max(8, steps // 2), overlap=True, sampling=kind)
                result["sampler_variants"].append({"model": name, "batch_size": bs, "variant": kind,
                                                   "gpu_step_ms": t.gpu_ms, "step_ms": t.step_ms})
                log(f"  bs={bs:3d} {kind:8s} batch: gpu {t.gpu_ms:.3f} ms")
        # The features variant's cost: the same batch sizes as the plain graph rows, half the rows with
        # penalties and logprobs; `features_overhead` compares with the plain graph row of that size.
        for bs in batch_sizes:
            try:
                t = bench.run_loop(bench.graph, bs, steps, overlap=True, sampling="features")
                plain = next((r for r in result["rows"] if r["model"] == name and r["batch_size"] == bs
                              and r["mode"] == "graph"), None)
                floor_ms = bench.floor_ms(bs, copy_gbps)
                row = {"source": SOURCE, "model": name, "batch_size": bs, "mode": "graph-features", **_timing_fields(t),
                       "bucket": bench.graph.padded_size(bs, features=True), "floor_ms": floor_ms,
                       "floor_fraction": floor_ms / t.step_ms, "tokens_per_s": bs / (t.step_ms / 1e3),
                       "features_rows": (bs + 1) // 2, "features": FEATURES,
                       "features_overhead": t.step_ms / plain["step_ms"] if plain else None}
                result["rows"].append(row)
                log(f"  bs={bs:3d} graph-features step {t.step_ms:7.3f} ms (gpu {t.gpu_ms:.3f}) host "
                    f"{t.host_us:.0f} us" + (f", x{row['features_overhead']:.2f} the plain step" if plain else ""))
            except Exception as e:  # noqa: BLE001 - keep the other measurements
                traceback.print_exc()
                result["errors"].append(f"{name} bs={bs} graph-features: {e!r}")
        save()
        if not args.no_hf and device == "cuda":
            try:
                hf = hf_model_from(bench)
                del bench.eager
                for bs in [b for b in batch_sizes if b in hf_sizes]:
                    floor_ms = bench.floor_ms(bs, copy_gbps)
                    ms = hf_step_ms(hf, bs, 6 if args.quick else 8)
                    result["rows"].append({"source": SOURCE, "model": name, "batch_size": bs, "mode": "hf",
                                           "step_ms": ms, "floor_ms": floor_ms, "floor_fraction": floor_ms / ms,
                                           "tokens_per_s": bs / (ms / 1e3)})
                    log(f"  bs={bs:3d} hf    step {ms:7.3f} ms")
                    save()
                del hf
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                result["errors"].append(f"hf {name}: {e!r}")
        if args.compile and device == "cuda" and (args.compile_models is None or name in args.compile_models.split(",")):
            try:
                t0 = time.perf_counter()
                cb = compiled_runner(bench, buckets=(1, 64))
                cb.capture(progress=False)
                compile_s = time.perf_counter() - t0
                for bs in (1, 64):
                    t = bench.run_loop(cb, bs, steps, overlap=True)
                    plain = next(r for r in result["rows"] if r["model"] == name and r["batch_size"] == bs
                                 and r["mode"] == "graph")
                    result["compile"].append({"model": name, "batch_size": bs, "compile_and_capture_s": compile_s,
                                              "gpu_step_ms_compiled": t.gpu_ms, "step_ms_compiled": t.step_ms,
                                              "gpu_step_ms_plain": plain["gpu_step_ms"], "floor_ms": plain["floor_ms"],
                                              "floor_fraction_compiled": plain["floor_ms"] / t.step_ms})
                    log(f"  compiled bs={bs}: gpu {t.gpu_ms:.3f} ms vs plain {plain['gpu_step_ms']:.3f}")
                del cb
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                result["errors"].append(f"compile: {e!r}")
        save()
        log(f"  {name} done in {time.perf_counter() - t_model:.0f}s")
        del bench
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    save()
    try:
        plot(result, out_path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result["errors"].append(f"plot: {e!r}")
        save()
    for line in summary_lines(result):
        log(line)
    log(f"wrote {out_path}" + (f"; errors: {result['errors']}" if result["errors"] else ""))
    return 1 if result["errors"] else 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        for mode, style in (("graph", "o-"), ("graph-features", "d-."), ("eager", "s--"), ("hf", "^:")):
            rows = sorted((r for r in result["rows"] if r["model"] == name and r["mode"] == mode),
                          key=lambda r: r["batch_size"])
            if rows:
                ax.plot([r["batch_size"] for r in rows], [r["step_ms"] for r in rows], style, label=mode)
        floor = sorted({(r["batch_size"], r["floor_ms"]) for r in result["rows"] if r["model"] == name})
        ax.plot([b for b, _ in floor], [f for _, f in floor], "k-", lw=1, label="memory floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"{name}, 512-token prompts, bf16 ({result['copy_GBps']:.0f} GB/s copy)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
