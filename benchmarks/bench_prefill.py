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

Short passes (`--mode short`, rows with `mode: "short"`): 1x16, 1x128, 4x128 and 1x512 tokens, as the
prefill worker runs them, i.e. replayed as CUDA graphs at token buckets (cluster/engine/prefill_graph_runner.py,
buckets up to 512 tokens). Per row: `wall_ms`, the host's time from the call to the logits being on
the device (median, synchronised); `device_ms`, the same pass's time on the GPU alone (CUDA events
around it, its launches queued behind a sleep kernel so no host gap is inside); `kernels`, the kernels
one pass runs (torch.profiler); and the same three for the eager pass (`eager_*`) for comparison.
Target: wall_ms <= 1.3 x device_ms. With --mode short an existing --out file keeps its other rows and
fields (its short rows are replaced).

    python -m benchmarks.bench_prefill [--out loadtest/results/prefill_h200.json] [--mode mixes|short|all]
    python -m benchmarks.bench_prefill --dry-run --out /tmp/prefill.json   # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from cluster.kv.kv_cache import KVCacheSpec
from cluster.model.loader import random_model
from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.engine.prefill_graph_runner import PrefillGraphRunner
from benchmarks.common import BLOCK_SIZE, arch_of, model_flops

MIXES = [(32, 128), (8, 512), (2, 2048), (1, 4096)]
DRY_MIXES = [(4, 16), (1, 64)]
SHORT = [(1, 16), (1, 128), (4, 128), (1, 512)]
DRY_SHORT = [(1, 16), (2, 24)]
SHORT_MAX_TOKENS = 512  # the prefill worker's default prefill_graph_max_tokens
SLEEP_MS = 200  # queued ahead of a pass whose device time is measured: longer than any pass's launches


def log(*a):
    print(*a, flush=True)


def device_timing(times_ms: list[float], launches_s: list[float], reached: list[bool]) -> dict:
    """_device_ms's verdict over its reps: the median event time is the pass's device time only if in no
    rep the GPU reached the pass (the end of the sleep) before the host had enqueued all of it (a launch
    time under the sleep does not prove that: the sleep starts before the host clock does, and its length
    in cycles is calibrated at one clock rate)."""
    launch_ms = statistics.median(launches_s) * 1e3
    if any(reached):
        return {"device_ms": None, "launch_ms": launch_ms, "host_sync": True}
    return {"device_ms": statistics.median(times_ms), "launch_ms": launch_ms, "host_sync": False}


def is_short_error(error: str) -> bool:
    """An `errors` entry of run_short's ("<model> short ...")."""
    return error.split(" ", 2)[1:2] == ["short"]


def source_commit() -> str | None:
    """The checkout's commit (None where the tree is a copy without git, as on the device machine)."""
    try:
        r = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                           check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


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

    # -- short passes --------------------------------------------------------------------------------
    def capture_graphs(self) -> PrefillGraphRunner:
        graphs = PrefillGraphRunner(self.model, self.runner.kv_cache, BLOCK_SIZE, self.spec.num_blocks,
                                    SHORT_MAX_TOKENS)
        graphs.capture()
        return graphs

    def short_pass(self, chunks, graphs: PrefillGraphRunner | None, reps: int) -> dict:
        """wall_ms, device_ms and kernels of one pass (graphed when `graphs` is given, else eager)."""
        self.runner.prefill_graphs = graphs
        try:
            for _ in range(3 if self.device == "cuda" else 1):
                self.runner.prefill(chunks)  # warm-up
            walls = []
            for _ in range(reps):
                sync(self.device)
                t0 = time.perf_counter()
                self.runner.prefill(chunks)
                sync(self.device)
                walls.append(time.perf_counter() - t0)
            out = {"wall_ms": statistics.median(walls) * 1e3}
            if self.device == "cuda":
                kernels, busy_ms = self._kernels(chunks)
                out.update(self._device_ms(chunks, reps), kernels=kernels, kernel_busy_ms=busy_ms)
                if out["device_ms"] is None:  # the pass syncs the host: timed by its kernels' own durations
                    out["device_ms"] = busy_ms
            else:  # the dry run: the CPU ran it synchronously
                out.update(device_ms=out["wall_ms"], kernels=None, launch_ms=None)
            return out
        finally:
            self.runner.prefill_graphs = None

    def _device_ms(self, chunks, reps: int) -> dict:
        """The pass on the GPU alone: its launches are queued behind a sleep kernel, then CUDA events around
        it time the kernels back to back. That holds only while the GPU is still in the sleep when the host
        has enqueued the whole pass; a pass that waits on the GPU inside (the eager pass reads a device value
        on the host) lets the sleep run out first, and its events then time host gaps too: device_ms None
        and `host_sync` True (the caller takes the sum of its kernels' durations)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(10**7)
        end.record()
        torch.cuda.synchronize()
        cycles = int(10**7 * SLEEP_MS / start.elapsed_time(end))  # the sleep kernel counts clock cycles
        times, launches, reached = [], [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            start.record()
            self.runner.prefill(chunks)
            end.record()
            launches.append(time.perf_counter() - t0)
            reached.append(start.query())  # True: the GPU got to the pass before the host had enqueued it all
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return device_timing(times, launches, reached)

    def _kernels(self, chunks) -> tuple[int, float]:
        """(kernels one pass runs on the GPU, the sum of their durations in ms); copies and memsets not
        counted."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.runner.prefill(chunks)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return len(kernels), sum(e.device_time_total for e in kernels) / 1e3

    def _set_backend(self, backend) -> None:
        self.model.attention_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, small mixes: checks the script")
    ap.add_argument("--out", default="loadtest/results/prefill_h200.json")
    ap.add_argument("--models", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--commit", default=None,
                    help="the source's commit, recorded with the short rows (default: git rev-parse, if a checkout)")
    ap.add_argument("--mode", choices=("mixes", "short", "all"), default="all",
                    help="the packed mixes (MFU), the short passes (graphed vs eager, mode: short), or both")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    assert args.dry_run or torch.cuda.is_available(), "the prefill benchmark needs a GPU (or --dry-run)"
    models = args.models.split(",") if args.models else (["tiny-shape"] if args.dry_run else
                                                         ["llama-8b-shape", "llama-1b-shape"])
    mixes = DRY_MIXES if args.dry_run else MIXES
    reps = args.reps or (2 if args.dry_run else 8)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    command = " ".join(["python -m benchmarks.bench_prefill", *(sys.argv[1:] if argv is None else argv)])
    if args.mode == "short" and out_path.exists():  # the other rows and fields stay; the short rows are replaced
        result = json.loads(out_path.read_text())
        result["rows"] = [r for r in result.get("rows", []) if r.get("mode") != "short"]
        result["errors"] = [e for e in result.get("errors", []) if not is_short_error(e)]  # replaced with the rows
    else:
        peak = matmul_tflops(device) if args.mode != "short" else None
        result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
                  "torch": torch.__version__, "command": command, "matmul_tflops": peak,
                  "flops": "2 x matmul weights per token (LM head: last token per prompt) + causal attention",
                  "rows": [], "errors": []}
    if args.mode != "mixes":
        result["short"] = {"command": command, "commit": args.commit or source_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__, "graphs": {},
                           "note": "mode short: wall_ms = host call to logits on the device (median); device_ms = "
                                   "the pass alone on the GPU (events, launches queued behind a sleep); kernels per "
                                   "pass (torch.profiler); eager_*: the same pass without graphs"}

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    for name in models:
        bench = PrefillBench(name, device)
        if args.mode != "mixes":
            run_short(bench, name, DRY_SHORT if args.dry_run else SHORT, reps, result)
            save()
        for prompts, length in mixes if args.mode != "short" else []:
            peak = result["matmul_tflops"]
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


def run_short(bench: PrefillBench, name: str, passes, reps: int, result: dict) -> None:
    """The short passes' rows: graphed (the prefill worker's path) and eager, per pass."""
    try:
        graphs = bench.capture_graphs()
        result["short"]["graphs"][name] = graphs.summary()
    except Exception as e:  # noqa: BLE001 - keep the other measurements
        traceback.print_exc()
        result["errors"].append(f"{name} short: capture: {e!r}")
        return
    for prompts, length in passes:
        try:
            chunks = bench.chunks(prompts, length)
            graphed = bench.short_pass(chunks, graphs, reps * 4)
            eager = bench.short_pass(chunks, None, reps)
            row = {"model": name, "mode": "short", "prompts": prompts, "prompt_len": length, **graphed,
                   "bucket": graphs.bucket_for(chunks), "wall_over_device": graphed["wall_ms"] / graphed["device_ms"],
                   **{f"eager_{k}": v for k, v in eager.items()}}
            result["rows"].append(row)
            log(f"  {name} short {prompts}x{length}: wall {row['wall_ms']:.3f} ms, device {row['device_ms']:.3f} ms "
                f"({row['wall_over_device']:.2f}x), {row['kernels']} kernels; eager wall {row['eager_wall_ms']:.3f} ms, "
                f"{row['eager_kernels']} kernels")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["errors"].append(f"{name} short {prompts}x{length}: {e!r}")


if __name__ == "__main__":
    main()
