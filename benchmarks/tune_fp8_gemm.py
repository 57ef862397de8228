"""Tunes the FP8 GEMM kernels (cluster/kernels/fp8_gemm.py) on one GPU and writes the table that
cluster/kernels/fp8_gemm_configs.py reads: per (N, K, M bucket) the best weight-only config, the best
Triton W8A8 config, and the fastest path of the three (weight-only, Triton W8A8, torch._scaled_mm).

For the Llama-3.1-8B and Llama-3.2-1B linear shapes at every M bucket (1 .. 256 rows), it times each
candidate (BLOCK_M/N/K, num_warps, num_stages, then split_k) inside a CUDA graph: one captured call per
weight copy, enough copies that they overflow L2 (60 MB on an H200), so every call reads HBM, as a
decode step does; the W8A8 paths include their activation quantization. A candidate whose output is
off its torch reference (cluster/kernels/reference.py) is dropped, not timed. The search is in two
rounds per shape and M: every tile config at the default split, then the best few at every split.
Kernels are compiled first, in parallel worker processes (Triton's disk cache then serves the timing
process). Prints a table of the best weight bytes per second per shape and M last, against the
device-to-device copy bandwidth measured here (bytes read + written, as benchmarks/bench_decode.py).

    python -m benchmarks.tune_fp8_gemm --out /tmp/fp8_gemm_configs.json   # one H200, about 3 minutes
    python -m benchmarks.tune_fp8_gemm --dry-run --out /tmp/t.json        # CPU, Triton's interpreter

Commit the output as cluster/kernels/fp8_gemm_configs.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from dataclasses import astuple, replace
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # (N, K) of each linear: fused qkv, o, fused gate_up, down
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
DRY_SHAPES = {"tiny": {"a": (96, 256), "b": (64, 384)}}
DRY_ROWS = (1, 20)
ROTATE_BYTES = 192 << 20  # weight copies per shape: about three times an H200's L2
MAX_COPIES = 24
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# (BLOCK_N, BLOCK_K, num_warps) per path; BLOCK_M follows the rows (block_ms); stages swept over STAGES.
WEIGHT_ONLY_TILES = ((64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4), (128, 256, 8), (64, 64, 4),
                     (128, 64, 4), (256, 128, 8))
W8A8_TILES = ((64, 128, 4), (128, 128, 4), (128, 256, 4), (64, 256, 4), (128, 128, 8), (256, 128, 8),
              (128, 64, 4), (256, 256, 8))
STAGES = (3, 4, 5)
SHARED_BYTES = 220 << 10  # of the 227 KB an sm_90 program may take
ROUND2 = 4  # tile configs of round one that round two sweeps over every split
REL_TOL = 5e-3  # ||out - reference|| / ||reference||; bf16 output rounding alone is ~1e-4 .. 1e-3


def log(*a):
    print(*a, flush=True)


# -- candidates ----------------------------------------------------------------------------------------
def block_ms(path: str, m: int) -> list[int]:
    """M tiles to try: the smallest holding the rows (at least 16, wgmma's N for our swap-AB product),
    capped at 64 rows for weight-only (its widened weight tile lives in registers beside the accumulator)."""
    bm = max(16, 1 << (m - 1).bit_length())
    if path == "weight_only":
        return [min(bm, 64)]
    return [bm] if bm <= 64 else [128, 64] if bm == 128 else [128, 256]


def tile_configs(path: str, m: int, dry: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) that fit shared memory and registers."""
    from cluster.kernels.fp8_gemm_configs import GemmConfig

    tiles = WEIGHT_ONLY_TILES if path == "weight_only" else W8A8_TILES
    out = []
    for bm, (bn, bk, warps), stages in itertools.product(block_ms(path, m), tiles, STAGES):
        x_bytes = 2 if path == "weight_only" else 1
        if stages * (bn * bk + bk * bm * x_bytes) > SHARED_BYTES:
            continue
        regs = bn * bm / (32 * warps) + (bn * bk / (64 * warps) if path == "weight_only" else 0)
        if regs > 160:  # accumulator (+ the widened weight tile): would spill
            continue
        out.append(GemmConfig(bm, bn, bk, 1, warps, stages))
    if dry:  # two configs, small enough for tiny shapes
        out = [GemmConfig(16, 32, 64, 1, 4, 2), GemmConfig(16, 16, 32, 1, 4, 1)]
    return out


def split_choices(cfg, m: int, n: int, k: int, sms: int) -> list[int]:
    """Splits whose grid covers between half the SMs and 12 waves (every split of at least one step)."""
    from cluster.kernels.fp8_gemm_configs import MAX_SPLIT_M_TILES

    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    steps = -(-k // cfg.block_k)
    if -(-m // cfg.block_m) > MAX_SPLIT_M_TILES:
        return [1]
    # Past K / (8 M) splits the float32 partials move more bytes than the weight: never faster.
    out = [s for s in SPLITS if s <= steps and (s == 1 or tiles * s >= sms // 2) and tiles * s <= 12 * sms
           and (s == 1 or s <= k // (8 * m))]
    return out or [1]


def default_split(cfg, m: int, n: int, k: int, sms: int) -> int:
    """Round one's split for a tile config: the choice nearest three programs per SM."""
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    return min(split_choices(cfg, m, n, k, sms), key=lambda s: abs(tiles * s - 3 * sms))


# -- compiling in parallel --------------------------------------------------------------------------------
# Errors that mean the config itself cannot be built (anything else, a worker's own trouble, leaves the
# config to the timing process, which compiles what the cache lacks).
_CONFIG_ERRORS = ("CompilationError", "OutOfResources", "PTXASError")


def _compile_one(path: str, cfg_json: dict) -> str | None:
    """In a worker process: one launch of the config on small inputs of the same specialization
    (multiples of 16, 16-byte aligned, M and split_k unspecialized), which compiles it into Triton's
    disk cache. Returns an error message ("ExceptionClass: first line"), or None."""
    try:
        from cluster.kernels.fp8_gemm import fp8_gemm, fp8_gemm_w8a8
        from cluster.kernels.fp8_gemm_configs import GemmConfig

        cfg = GemmConfig.from_json(cfg_json)
        n, k = 256, 1024
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        s = torch.ones(n, device="cuda")
        if path == "weight_only":
            fp8_gemm(x, w, s, None, None, None, cfg)
        else:
            fp8_gemm_w8a8(x.to(torch.float8_e4m3fn), torch.ones(16, 1, device="cuda"), w, s, None, torch.bfloat16,
                          None, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported, the config is dropped
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def precompile(variants: list[tuple[str, object]], workers: int) -> dict[tuple[str, object], str]:
    """Compiles every (path, config) in `workers` processes; returns the ones that cannot be built, with
    why. A worker that breaks (or fails for another reason) only costs the cache entries it would have
    written: the timing process compiles those itself."""
    failed, other = {}, []
    ctx = multiprocessing.get_context("spawn")  # CUDA in the workers: no fork
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = {pool.submit(_compile_one, path, cfg.to_json()): (path, cfg) for path, cfg in variants}
            for f in cf.as_completed(futures):
                try:
                    err = f.result()
                except Exception as e:  # noqa: BLE001 - a broken pool: compile in the timing process
                    err = f"worker: {type(e).__name__}: {e}"
                if err is not None and err.startswith(_CONFIG_ERRORS):
                    failed[futures[f]] = err
                elif err is not None:
                    other.append(err)
    except Exception as e:  # noqa: BLE001
        other.append(f"pool: {type(e).__name__}: {e}")
    if other:
        log(f"  {len(other)} configs left to the timing process to compile, e.g. {other[0][:200]}")
    return failed


# -- timing ----------------------------------------------------------------------------------------------
def time_calls_us(calls, device: str, reps: int) -> float:
    """Median microseconds per call of calls[i]() over one round of all of them (each its own weight
    copy): replays of a CUDA graph holding the round on CUDA, wall time on CPU."""
    if device != "cuda":
        # The dry run (CPU): Triton's interpreter compiles nothing and no graph is captured, so a warm-up
        # round would only repeat the work of the timed rounds.
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for c in calls:
                c()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / len(calls) * 1e6
    for c in calls:  # warm-up (and, under capture, nothing compiles)
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3)
    del g
    return statistics.median(ts) / len(calls)


class ShapeBench:
    """Weight copies (e4m3 and bf16) of one (N, K); `at(m)` draws the activations and references of m rows."""

    def __init__(self, n: int, k: int, device: str, dtype: torch.dtype, copies: int, gen: torch.Generator):
        from cluster.kernels.fp8_gemm import make_locks
        from cluster.model.linear import quantize_weight_per_channel

        self.n, self.k, self.device, self.dtype, self.gen = n, k, device, dtype, gen
        self.w, self.s, self.w16 = [], [], []
        for _ in range(copies):
            w = torch.randn(n, k, device=device, generator=gen).to(dtype) * k**-0.5
            q, s = quantize_weight_per_channel(w)
            self.w.append(q)
            self.s.append(s)
            self.w16.append(w)
        self.locks = make_locks(n, device)

    def at(self, m: int) -> "ShapeBench":
        from cluster.kernels import reference
        from cluster.kernels.fp8_quant import quantize_per_token

        self.m = m
        self.x = torch.randn(m, self.k, device=self.device, generator=self.gen).to(self.dtype)
        self.ref = {"weight_only": reference.fp8_linear_weight_only(self.x, self.w[0], self.s[0], None).float()}
        # W8A8's reference takes the quantizer kernel's own output, so that the check isolates the GEMM
        # (the quantizer is tested against its reference in tests/cluster/kernels).
        xq, xs = quantize_per_token(self.x)
        self.ref["w8a8"] = ((xq.float() @ self.w[0].float().t()) * xs * self.s[0][None, :]).to(self.dtype).float()
        self.ref["scaled_mm"] = reference.fp8_linear_w8a8(self.x, self.w[0], self.s[0], None).float()
        return self

    def calls(self, path: str, cfg=None):
        from cluster.kernels.fp8_gemm import fp8_gemm, fp8_gemm_w8a8
        from cluster.kernels.fp8_quant import quantize_per_token
        from cluster.model.linear import fp8_linear_w8a8

        x, lk = self.x, self.locks
        if path == "weight_only":
            return [lambda i=i: fp8_gemm(x, self.w[i], self.s[i], None, None, lk, cfg) for i in range(len(self.w))]
        if path == "w8a8":
            def one(i):
                xq, xs = quantize_per_token(x)
                return fp8_gemm_w8a8(xq, xs, self.w[i], self.s[i], None, x.dtype, lk, cfg)
            return [lambda i=i: one(i) for i in range(len(self.w))]
        if path == "scaled_mm":
            return [lambda i=i: fp8_linear_w8a8(x, self.w[i], self.s[i], None, None, True) for i in range(len(self.w))]
        raise ValueError(path)

    def error(self, path: str, out: torch.Tensor) -> float:
        ref = self.ref[path]
        out = out.float()
        if not torch.isfinite(out).all():
            return math.inf
        return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()

    def weight_tbps(self, us: float, elem_bytes: int = 1) -> float:
        return self.n * self.k * elem_bytes / (us * 1e-6) / 1e12


def tune_point(b: ShapeBench, paths: list[str], sms: int, reps: int, failed: dict, dry: bool, detail: list,
               deadline: float = math.inf) -> dict:
    """Every candidate at one (shape, M): returns {path: (us, config or None)} of the best valid ones.
    Past the deadline, round two (the splits) is skipped: a late table is still a whole table."""
    best = {}
    for path in paths:
        if path == "scaled_mm":  # cuBLASLt's (on CPU: the torch reference's, for the dry run)
            calls = b.calls(path)
            err = b.error(path, calls[0]())
            us = time_calls_us(calls, b.device, reps) if err < REL_TOL else math.inf
            detail.append({"N": b.n, "K": b.k, "M": b.m, "path": path, "us": us, "rel_error": err})
            best[path] = (us, None)
            continue
        timed = []

        def run(cfg):
            if (path, _base(cfg)) in failed:
                return math.inf
            try:
                calls = b.calls(path, cfg)
                err = b.error(path, calls[0]())
                if not err < REL_TOL:
                    detail.append({"N": b.n, "K": b.k, "M": b.m, "path": path, "config": cfg.to_json(),
                                   "rel_error": err, "skipped": "wrong output"})
                    return math.inf
                us = time_calls_us(calls, b.device, reps)
            except Exception as e:  # noqa: BLE001 - a config that cannot run is dropped
                detail.append({"N": b.n, "K": b.k, "M": b.m, "path": path, "config": cfg.to_json(),
                               "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
                return math.inf
            detail.append({"N": b.n, "K": b.k, "M": b.m, "path": path, "config": cfg.to_json(), "us": us,
                           "rel_error": err})
            return us

        for cfg in tile_configs(path, b.m, dry):  # round one: each tile config at its default split
            cfg = _with_split(cfg, default_split(cfg, b.m, b.n, b.k, sms))
            timed.append((run(cfg), cfg))
        timed.sort(key=lambda t: t[0])
        late = time.perf_counter() > deadline
        for _, cfg in [t for t in timed if math.isfinite(t[0])][:0 if late else ROUND2]:  # round two: every split
            for split in split_choices(cfg, b.m, b.n, b.k, sms)[:2 if dry else None]:
                if split != cfg.split_k:
                    c = _with_split(cfg, split)
                    timed.append((run(c), c))
        timed.sort(key=lambda t: t[0])
        best[path] = timed[0] if timed and math.isfinite(timed[0][0]) else (math.inf, None)
    return best


def _with_split(cfg, split: int):
    return replace(cfg, split_k=split)


def _base(cfg):
    """The compile key of a config: everything but the split."""
    return _with_split(cfg, 1)


# -- main ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune_fp8_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the table (commit it as cluster/kernels/fp8_gemm_configs.json)")
    ap.add_argument("--detail", default=None, help="every timing and every dropped config, as JSON")
    ap.add_argument("--dry-run", action="store_true", help="CPU under Triton's interpreter: tiny shapes, two configs")
    ap.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated of {','.join(SHAPES)}")
    ap.add_argument("--rows", default=None, help="comma-separated M values (default: every M bucket)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--reps", type=int, default=7, help="graph replays per timing (the median is kept)")
    ap.add_argument("--w8a8-min-m", type=int, default=1,
                    help="rows below which the W8A8 paths are not candidates (keeps weight-only numerics at small "
                         "batch; their configs are still tuned and stored)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="past this many seconds, shapes still to come skip the split sweep (round two)")
    args = ap.parse_args(argv)
    if args.dry_run:
        # Before triton is imported: the kernels run under the interpreter (tests also patch it, see
        # tests/triton_interpreter.py; float32 activations need none of those patches).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cpu" if args.dry_run else "cuda"
    assert args.dry_run or torch.cuda.is_available(), "the tuner needs a GPU (or --dry-run)"
    import triton

    from cluster.kernels import fp8_gemm_configs
    from cluster.kernels.fp8_gemm_configs import M_BUCKETS, PATHS
    from benchmarks.common import copy_bandwidth_gbps

    t0 = time.perf_counter()
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shapes = DRY_SHAPES if args.dry_run else {m: SHAPES[m] for m in args.models.split(",")}
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(DRY_ROWS if args.dry_run else M_BUCKETS)
    sms = fp8_gemm_configs.num_sms(torch.device(device))
    copy_gbps = copy_bandwidth_gbps(device)
    if device == "cuda":
        torch.cuda.empty_cache()  # the copy's buffers: room for the compile workers' contexts
    log(f"copy bandwidth {copy_gbps:.0f} GB/s, {sms} SMs, triton {triton.__version__}, torch {torch.__version__}")

    failed: dict = {}
    if not args.dry_run:
        variants = sorted({(p, _base(c)) for p in ("weight_only", "w8a8") for m in rows
                           for c in tile_configs(p, m, False)}, key=lambda v: (v[0], astuple(v[1])))
        failed = precompile(variants, args.workers)
        log(f"compiled {len(variants)} kernels ({len(failed)} failed) in {time.perf_counter() - t0:.0f} s")
        for (p, c), err in list(failed.items())[:5]:
            log(f"  not compiled: {p} {c}: {err}")

    gen = torch.Generator(device=device).manual_seed(0)
    entries, detail = [], []
    for model, table in shapes.items():
        for name, (n, k) in table.items():
            copies = 1 if args.dry_run else max(2, min(MAX_COPIES, -(-ROTATE_BYTES // (n * k))))
            shape = ShapeBench(n, k, device, dtype, copies, gen)
            for m in rows:
                b = shape.at(m)
                best = tune_point(b, list(PATHS), sms, 1 if args.dry_run else args.reps, failed, args.dry_run, detail,
                                  t0 + args.budget_s)
                bf16_us = time_calls_us([lambda w=w: F.linear(b.x, w) for w in b.w16], device,
                                        1 if args.dry_run else args.reps)
                allowed = [p for p in best if p == "weight_only" or m >= args.w8a8_min_m]
                path = min(allowed, key=lambda p: best[p][0])
                if not math.isfinite(best[path][0]) or best["weight_only"][1] is None:
                    log(f"  {model} {name} M={m}: no valid weight-only config; left out of the table")
                    continue
                bucket = fp8_gemm_configs.m_bucket(m)
                us = {p: best[p][0] for p in best}
                entry = {"model": model, "shape": name, "N": n, "K": k, "M": bucket, "path": path,
                         "weight_only": best["weight_only"][1].to_json(),
                         "w8a8": best["w8a8"][1].to_json() if best["w8a8"][1] is not None else None,
                         "us": {p: (v if math.isfinite(v) else None) for p, v in us.items()}, "bf16_us": bf16_us,
                         "weight_TBps": b.weight_tbps(us[path]), "bf16_weight_TBps": b.weight_tbps(bf16_us, 2),
                         "copy_fraction": b.weight_tbps(us[path]) * 1e3 / copy_gbps}
                if path == "w8a8" and entry["w8a8"] is None:
                    entry["path"] = "weight_only"
                entries.append(entry)
                log(f"  {model:9s} {name:8s} {n:6d}x{k:<6d} M={m:3d}: {path:11s} {us[path]:8.2f} us "
                    f"{entry['weight_TBps']:5.2f} TB/s ({entry['copy_fraction']:4.0%} of copy) | "
                    + " ".join(f"{p} {v:.2f}" for p, v in us.items() if math.isfinite(v)) + f" | bf16 {bf16_us:.2f}")
            del shape, b
            if device == "cuda":
                torch.cuda.empty_cache()

    capability = list(torch.cuda.get_device_capability()) if device == "cuda" else None
    data = {"version": 1, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
            "capability": capability, "triton": triton.__version__, "torch": torch.__version__,
            "copy_GBps": copy_gbps, "command": " ".join(sys.argv), "seconds": time.perf_counter() - t0,
            "note": "written by benchmarks/tune_fp8_gemm.py; us per call inside CUDA graphs with rotating weights "
                    "(W8A8 paths include the activation quantization); weight_TBps counts e4m3 weight bytes",
            "entries": entries}
    fp8_gemm_configs.parse_table(data)  # what we write must load
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    if args.detail:
        Path(args.detail).write_text(json.dumps(detail, indent=1))
    log(summary(entries, rows, copy_gbps))
    log(f"wrote {args.out} ({len(entries)} entries) in {data['seconds']:.0f} s")
    return 0 if entries else 1


def summary(entries: list[dict], rows: list[int], copy_gbps: float) -> str:
    """Best FP8 weight TB/s per shape and M, the path's initial (w: weight-only, t: Triton W8A8,
    s: _scaled_mm), and the bf16 F.linear TB/s for comparison."""
    from cluster.kernels.fp8_gemm_configs import m_bucket

    tag = {"weight_only": "w", "w8a8": "t", "scaled_mm": "s"}
    buckets = sorted({m_bucket(m) for m in rows})
    lines = ["", f"best FP8 weight TB/s (w weight-only, t Triton W8A8, s _scaled_mm; copy {copy_gbps / 1e3:.2f} TB/s)"
                 "  | bf16 F.linear TB/s",
             f"{'shape':22s}" + "".join(f"{'M' + str(m):>8s}" for m in buckets) + "  | "
             + " ".join(f"M{m}" for m in buckets)]
    for key in sorted({(e["model"], e["shape"], e["N"], e["K"]) for e in entries}):
        row = {e["M"]: e for e in entries if (e["model"], e["shape"], e["N"], e["K"]) == key}
        cells = "".join(f"{row[m]['weight_TBps']:7.2f}{tag[row[m]['path']]}" if m in row else f"{'-':>8s}"
                        for m in buckets)
        ref = " ".join(f"{row[m]['bf16_weight_TBps']:.2f}" if m in row else "-" for m in buckets)
        lines.append(f"{key[0][6:] + ' ' + key[1] + f' {key[2]}x{key[3]}':22s}{cells}  | {ref}")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
