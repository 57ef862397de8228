"""Prefill benchmark on one GPU: one packed forward over a batch of fresh prompts, as the prefill worker
runs it (ModelRunner.prefill: inputs built and uploaded, every layer, each prompt's last-token logits),
with MFU against the dense bf16 matmul rate measured in the same run.

Random bf16 weights with the shapes of Llama-3.1-8B and Llama-3.2-1B; mixes 32x128, 8x512, 2x2048 and
1x4096 prompt tokens. Model FLOPs per forward: 2 x (matmul weights) per token, the LM head only for
each prompt's last token, plus causal attention, 2 x 2 x heads x head_dim x sum(L (L + 1) / 2) per
layer (QK^T and PV over the keys each query sees). The matmul rate is the median of a square bf16
GEMM (8192^3). Each row also carries the attention kernel's share of the device time (torch.profiler
over one forward) and, for comparison, the same forward with the torch reference attention (one SDPA
call per prompt).

    python -m benchmarks.bench_prefill [--out loadtest/results/prefill_h200.json]
    python -m benchmarks.bench_prefill --dry-run --out /tmp/prefill.json   # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from cluster.kv_cache import KVCacheSpec
from cluster.model.loader import random_model
from cluster.model_runner import ModelRunner, PrefillChunk
from benchmarks.common import BLOCK_SIZE, arch_of, model_flops

MIXES = [(32, 128), (8, 512), (2, 2048), (1, 4096)]
DRY_MIXES = [(4, 16), (1, 64)]


def log(*a):
    print(*a, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(device: str, n: int = 8192, reps: int = 20) -> float:
    """Dense bf16 GEMM rate (n x n x n), the denominator of MFU."""
    if device != "cuda":
        n, reps = 512, 3
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


class PrefillBench:
    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self.arch = arch_of(name)
        torch.manual_seed(0)
        backend = "triton" if device == "cuda" else "torch"  # Triton has no CPU backend (--dry-run)
        self.model = random_model(self.arch, torch.bfloat16, device, attention_backend=backend)
        max_tokens = max(n * length for n, length in (MIXES if device == "cuda" else DRY_MIXES))
        blocks = max_tokens // BLOCK_SIZE + 64
        self.spec = KVCacheSpec.for_model(self.arch, BLOCK_SIZE, blocks, torch.bfloat16)
        self.runner = ModelRunner(self.model, self.spec, device)

    def chunks(self, prompts: int, length: int) -> list[PrefillChunk]:
        gen = torch.Generator().manual_seed(prompts * length)
        per = self.spec.blocks_for_tokens(length)
        return [PrefillChunk(torch.randint(10, self.arch.vocab_size, (length,), generator=gen).tolist(), 0,
                             list(range(1 + i * per, 1 + (i + 1) * per))) for i in range(prompts)]

    def time_ms(self, chunks, reps: int) -> float:
        self.runner.prefill(chunks)  # warm-up (Triton compiles on first use)
        times = []
        for _ in range(reps):
            sync(self.device)
            t0 = time.perf_counter()
            self.runner.prefill(chunks)
            sync(self.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def attention_ms(self, chunks) -> float:
        """Device time of the attention kernels in one forward (torch.profiler)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.runner.prefill(chunks)
            torch.cuda.synchronize()
        us = sum(e.device_time_total for e in prof.events() if "attention" in e.name and str(e.device_type).endswith("CUDA"))
        return us / 1e3

    def with_torch_attention_ms(self, chunks, reps: int) -> float:
        """The same forward with the torch reference attention (the per-prompt SDPA loop)."""
        from cluster.attention import get_backend

        a = self.arch
        fused = self.model.attention_backend
        ref = get_backend("torch")(a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window)
        self._set_backend(ref)
        try:
            return self.time_ms(chunks, reps)
        finally:
            self._set_backend(fused)

    def _set_backend(self, backend) -> None:
        self.model.attention_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, small mixes: checks the script")
    ap.add_argument("--out", default="loadtest/results/prefill_h200.json")
    ap.add_argument("--models", default=None)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    assert args.dry_run or torch.cuda.is_available(), "the prefill benchmark needs a GPU (or --dry-run)"
    models = args.models.split(",") if args.models else (["tiny-shape"] if args.dry_run else
                                                         ["llama-8b-shape", "llama-1b-shape"])
    mixes = DRY_MIXES if args.dry_run else MIXES
    reps = args.reps or (2 if args.dry_run else 8)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    peak = matmul_tflops(device)
    log(f"dense bf16 matmul: {peak:.0f} TFLOP/s")
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "command": " ".join(sys.argv), "matmul_tflops": peak,
              "flops": "2 x matmul weights per token (LM head: last token per prompt) + causal attention",
              "rows": [], "errors": []}

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    for name in models:
        bench = PrefillBench(name, device)
        for prompts, length in mixes:
            try:
                chunks = bench.chunks(prompts, length)
                ms = bench.time_ms(chunks, reps)
                flops = model_flops(bench.arch, [length] * prompts)
                row = {"model": name, "prompts": prompts, "prompt_tokens": prompts * length, "ms": ms,
                       "tokens_per_s": prompts * length / (ms / 1e3), "mfu": flops / (ms / 1e3) / (peak * 1e12),
                       "tflops": flops / (ms / 1e3) / 1e12}
                if device == "cuda":
                    row["attention_ms"] = bench.attention_ms(chunks)
                    row["ms_torch_attention"] = bench.with_torch_attention_ms(chunks, max(2, reps // 4))
                result["rows"].append(row)
                log(f"  {name} {prompts}x{length}: {ms:.2f} ms, {row['tokens_per_s']:.0f} tok/s, "
                    f"{row['tflops']:.0f} TFLOP/s, MFU {row['mfu']:.1%}"
                    + (f", attention {row['attention_ms']:.2f} ms, torch attention {row['ms_torch_attention']:.1f} ms"
                       if device == "cuda" else ""))
            except Exception as e:  # noqa: BLE001 - keep the other measurements
                traceback.print_exc()
                result["errors"].append(f"{name} {prompts}x{length}: {e!r}")
            save()
        del bench
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    save()
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
