"""KV transfer benchmark, Llama-3.1-8B KV shape by default (bf16, 32 layers, 8 KV heads, head_dim 128).

Prefill and decode run in two processes (torch.multiprocessing spawn) sharing one TCPStore, each with
its real transport; no Ray. The prefill side runs the served path's order (prefill_worker.py): claim
(`begin`, before the forward), the forward (here a wait of `lead_ms`: the 8B weights alone take 3.3 ms
to read at the H200's 4.8 TB/s, so no real forward is shorter than the default lead; the decode side
posts its receives meanwhile; path "nccl_cold" has no lead, its receives posted while the bytes
wait), `kv_done`, the first-token draw's sync of the compute stream, `commit`, then the payload's
future. Layer-wise shipping as the served path picks it (by prompt length: the transport's
layerwise_min_tokens) unless the caller forces it (bench_nccl: off). Per path and prompt length, one
row (medians):
  bytes, seconds       what a request's TTFT pays for the transfer: the prefill done (its compute
                       stream synced, as after the first-token draw) -> the decode process saw the
                       arrival (poll_arrivals after its wake-up); both processes read CLOCK_MONOTONIC
  served_transfer_s    the served path's own record of it (PrefillResult.transfer_s: prefill done ->
                       the payload's future resolved on the prefill side)
  commit_to_arrival_s  the commit sent -> the decode side saw the arrival (the control message, the
                       completion query, the wake-up)
  kv_ready_to_arrival_s  KV ready (`kv_done`) -> the decode side saw it: the copy itself included
                       (issue 25's transfer time)
  GBps                 bytes / kv_ready_to_arrival_s (bytes moved once)
  layerwise, lead_ms   the shipping mode and the begin -> KV ready lead of the row
  send_s               the prefill side alone: KV ready -> its payload done (source blocks reusable)
  claim_s              the store compare-and-set that claims the transfer; the prefill worker makes it
                       before the prompt's forward, so it is not part of `seconds`
  copy_GBps            a plain contiguous device-to-device copy of the same bytes, same process and run
  copy_kernel_GBps     same_gpu: the fused block-copy kernel alone, prefill cache -> another cache
  exact                the decode side's per-block checksums equal the prefill's
  prefill_s, ttft_transfer_share   8B prefill of that length (random weights) and seconds / (prefill + seconds)
  launches, staging_MiB the plan: messages of at most staging_MiB each (cluster/transport/plan.py)
Paths: same_gpu (CUDA IPC + fused copy, one GPU), gloo (CPU caches), nccl (two GPUs, default staging),
nccl_cold (no lead), nccl_slot16m / nccl_slot64m (16 / 64 MiB staging slots instead of the default).

    python benchmarks/bench_transfer.py --out loadtest/results                 # one GPU: same_gpu
    python benchmarks/bench_transfer.py --dry-run --out /tmp/x                 # CPU: gloo, tiny shape
    python benchmarks/bench_nccl.py --out loadtest/results                     # two GPUs (uses run_path)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.wire.messages import Reservation  # noqa: E402
from cluster.transport.base import KVSend  # noqa: E402
from cluster.transport.block_copy import copy_blocks  # noqa: E402
from cluster.transport.rendezvous_store import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from loadtest.report import percentile  # noqa: E402

SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def bytes_for(self, tokens: int) -> int:
        return tokens // self.block_size * self.layers * 2 * self.block_size * self.kv_heads * self.head_dim \
            * torch.empty((), dtype=self.torch_dtype).element_size()

    def describe(self) -> str:
        return f"L{self.layers} kvh{self.kv_heads} hd{self.head_dim} bs{self.block_size} {self.dtype}"


KV_SHAPES = {
    "llama-8b": KVShape(32, 8, 128, 16, "bfloat16"),
    "llama-1b": KVShape(16, 8, 64, 16, "bfloat16"),
    "tiny": KVShape(4, 2, 16, 16, "float32"),  # CPU dry runs
}
LEAD_S = 0.003  # begin -> KV ready (see the docstring)
PATH_SPECS = {  # path -> (transport kind, backend, spec overrides, lead seconds)
    "same_gpu": ("same_gpu", "gloo", {}, LEAD_S),
    "gloo": ("torch_dist", "gloo", {}, LEAD_S),
    "nccl": ("torch_dist", "nccl", {}, LEAD_S),
    "nccl_cold": ("torch_dist", "nccl", {}, 0.0),
    "nccl_slot16m": ("torch_dist", "nccl", {"staging_bytes": 16 << 20}, LEAD_S),
    "nccl_slot64m": ("torch_dist", "nccl", {"staging_bytes": 64 << 20}, LEAD_S),
}


def block_sums(cache: torch.Tensor, blocks: list[int]) -> list[int]:
    b = cache[:, :, blocks].contiguous().view(torch.uint8).to(torch.int64)
    return b.transpose(0, 2).reshape(len(blocks), -1).sum(-1).tolist()


def _cache(shape: KVShape, num_blocks: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn((shape.layers, 2, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim), generator=g,
                    device=device, dtype=torch.float32).to(shape.torch_dtype)
    t[:, :, 0] = 0  # the NULL block, as in a real cache
    return t


def _plan(sizes, reps):
    """(seq, tokens, rep) for every transfer, identical on both sides; dst blocks are 1..n+1."""
    out, seq = [], 0
    for n in sizes:
        for r in range(reps(n) + 1):  # +1 warm-up
            out.append((seq, n, r))
            seq += 1
    return out


def _reps(path, quick=False):
    if quick:
        return lambda n: 2
    return (lambda n: 3 if n >= 4096 else 5) if path == "gloo" else (lambda n: 20 if n <= 2048 else 10)


def _device(d: str) -> str:
    """First thing in a child process: "cuda:N" -> that GPU alone, seen as cuda:0 (as a Ray actor sees
    its GPU), so threads that use the current device (a DecodeWorker's loop) use the right one."""
    if d.startswith("cuda"):
        index = torch.device(d).index or 0
        assert not torch.cuda.is_initialized(), "pick the GPU before CUDA starts in this process"
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
        torch.cuda.set_device(0)
        return "cuda:0"
    torch.set_num_threads(1)  # CPU dry runs: two processes' OpenMP pools spin-waiting swamp every latency
    return d


def decode_proc(spec_d: dict, device: str, shape: KVShape, sizes, path, quick, q):
    device = _device(device)
    spec = TransportSpec(**spec_d)
    nb = max(sizes) // shape.block_size + 2
    pool = torch.zeros((shape.layers, 2, nb, shape.block_size, shape.kv_heads, shape.head_dim),
                       dtype=shape.torch_dtype, device=device)
    t = create_transport(spec, pool, "d0", "decode")
    wake = threading.Event()
    t.set_wakeup(wake.set)
    plan = _plan(sizes, _reps(path, quick))
    for seq, n, _ in plan:
        t.expect(Reservation(f"r{seq}", "d0", tuple(range(1, n // shape.block_size + 2)), seq), "p0")
    q.put(("decode_ready",))
    landed, sums, deadline = {}, {}, time.monotonic() + 600
    while len(landed) < len(plan) and time.monotonic() < deadline:
        # Clear, then look, then nap: a wake-up while we look (the payload landing just after its
        # commit woke us) stays set. Waiting first and clearing after lost it, and the arrival was
        # seen only at the 0.1 s timeout (the 20-45 ms medians of small transfers on two H200s).
        wake.clear()
        arrivals = t.poll_arrivals()
        if not arrivals:
            wake.wait(0.1)
            continue
        for a in arrivals:
            seq = a.reservation.transfer_seq
            landed[seq] = time.monotonic()
            if a.error:
                q.put(("error", f"decode: {a.reservation.request_id}: {a.error}"))
            n = plan[seq][1]
            if plan[seq][2] == 1:  # first measured rep of each size: check exactness
                sums[n] = block_sums(pool, list(a.reservation.block_ids[: n // shape.block_size]))
    q.put(("decode", landed, sums, {k: v for k, v in t.metrics().items() if k != "recent"}))
    time.sleep(1.0)
    t.close()


def prefill_proc(spec_d: dict, device: str, shape: KVShape, sizes, path, quick, lead_s, layerwise, q, go):
    device = _device(device)
    spec = TransportSpec(**spec_d)
    nb = max(sizes) // shape.block_size + 2
    src = _cache(shape, nb, device, seed=1)
    t = create_transport(spec, src, "p0", "prefill")
    go.wait()  # the decode side expects every transfer
    connect_s = t.connect(["d0"])["d0"]
    rows, sums = [], {}
    for seq, n, rep in _plan(sizes, _reps(path, quick)):
        blocks = tuple(range(1, n // shape.block_size + 1))
        res = Reservation(f"r{seq}", "d0", tuple(range(1, n // shape.block_size + 2)), seq)
        if rep == 1:
            sums[n] = block_sums(src, list(blocks))
        if src.is_cuda:
            torch.cuda.synchronize()
        c0 = time.monotonic()
        sh = t.begin([KVSend(res, n, blocks)], layerwise=layerwise)  # the worker claims before the forward
        c1 = time.monotonic()
        if lead_s:
            time.sleep(lead_s)  # the forward (the decode side posts its receives meanwhile)
        t0 = time.monotonic()
        sh.kv_done()  # every layer not shipped yet goes now, while the first token is drawn
        if src.is_cuda:
            torch.cuda.current_stream().synchronize()  # the draw's .tolist(): the compute stream only
        t_done = time.monotonic()
        # Read before the call: the decode side can see the arrival before commit() returns here (this
        # process descheduled after the send; seen on a loaded 2-core machine: commit_to_arrival < 0).
        t_commit = time.monotonic()
        sh.commit({res.request_id: 7})
        st = sh.futures[res.request_id].result(timeout=120)
        t1 = time.monotonic()
        rows.append((seq, n, rep, st.bytes, c1 - c0, t0, t1 - t0, t_done, t_commit, t1 - t_done))
    copy, kernel = {}, {}
    for n in sizes:  # the copy ceiling for the same bytes, this process, same run
        nbytes = shape.bytes_for(n)
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        copy[n] = nbytes / _time(lambda: b.copy_(a))
        if path == "same_gpu":  # the transport's copy kernel alone, into another cache
            dst_cache = torch.empty_like(src)
            ids = torch.arange(1, n // shape.block_size + 1, dtype=torch.int32, device=device)
            kernel[n] = nbytes / _time(lambda: copy_blocks(dst_cache, ids, src, ids))
            del dst_cache
        del a, b
    q.put(("prefill", rows, sums, copy, kernel, connect_s))
    time.sleep(0.5)
    t.close()


def _time(fn, reps=20) -> float:
    """Median seconds of fn(), timed with CUDA events (perf_counter on CPU, for dry runs)."""
    fn()
    if not torch.cuda.is_available():
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[reps // 2]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def run_path(path: str, sizes, prefill_device="cuda:0", decode_device="cuda:0", shape: KVShape = KV_SHAPES["llama-8b"],
             quick: bool = False, layerwise: bool | None = None) -> dict:
    """One path, prefill and decode in two fresh processes (devices as seen from this process);
    `layerwise` None: as the served path picks it (by prompt length)."""
    kind, backend, extra, lead_s = PATH_SPECS[path]
    store = start_store("127.0.0.1", 0)
    spec = dict(kind=kind, store_host="127.0.0.1", store_port=store.port, backend=backend, secret=os.urandom(32),
                namespace=f"bench-{path}-{os.getpid()}-{time.monotonic_ns()}", transfer_timeout_s=60.0, **extra)
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=decode_proc, args=(spec, decode_device, shape, sizes, path, quick, q)),
             ctx.Process(target=prefill_proc, args=(spec, prefill_device, shape, sizes, path, quick, lead_s, layerwise,
                                                        q, go))]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + 600
    while ("prefill" not in out or "decode" not in out) and time.monotonic() < deadline \
            and (any(p.is_alive() for p in procs) or not q.empty()):
        try:
            msg = q.get(timeout=1.0)
        except Exception:
            continue
        if msg[0] == "error":
            errors.append(msg[1])
        elif msg[0] == "decode_ready":
            go.set()
        else:
            out[msg[0]] = msg[1:]
    for p in procs:
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
    if "prefill" not in out or "decode" not in out:
        return {"path": path, "error": "; ".join(errors) or f"exit codes {[p.exitcode for p in procs]}", "rows": []}
    raw, psums, copy, kernel, connect_s = out["prefill"]
    landed, dsums, dmetrics = out["decode"]
    rows = []
    for n in sizes:
        meas = [(b, c, t0, s, seq, done, commit, served) for seq, m, rep, b, c, t0, s, done, commit, served in raw
                if m == n and rep > 0 and seq in landed]
        if not meas:
            continue
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        secs = sorted(landed[seq] - done for _, _, _, _, seq, done, _, _ in meas)
        ready = [landed[seq] - t0 for _, _, t0, _, seq, _, _, _ in meas]
        nbytes, sec = meas[0][0], med(secs)
        lw = layerwise if layerwise is not None else n >= TransportSpec(**spec).layerwise_min_tokens
        row = {"path": path, "prompt_tokens": n, "bytes": nbytes, "seconds": sec,
               "served_transfer_s": med([m[7] for m in meas]),
               "commit_to_arrival_s": med([landed[m[4]] - m[6] for m in meas]),
               "kv_ready_to_arrival_s": med(ready), "GBps": nbytes / med(ready) / 1e9,
               "layerwise": lw, "lead_ms": lead_s * 1e3, **plan_of(kind, spec, shape, n),
               "send_s": med([m[3] for m in meas]), "claim_s": med([m[1] for m in meas]),
               "p90_s": percentile(secs, 90), "copy_GBps": copy[n] / 1e9,
               "exact": psums.get(n) is not None and psums.get(n) == dsums.get(n), "reps": len(secs)}
        if n in kernel:
            row["copy_kernel_GBps"] = kernel[n] / 1e9
        rows.append(row)
    return {"path": path, "rows": rows, "errors": errors, "connect_s": connect_s,
            "decode_failures": dmetrics.get("failures", 0), "spec": {k: v for k, v in spec.items() if k not in ("store_port", "secret")}}


def plan_of(kind: str, spec: dict, shape: KVShape, tokens: int) -> dict:
    """The torch_dist plan of one transfer: how many launches (messages), of at most how much."""
    if kind != "torch_dist":
        return {}
    from cluster.transport.plan import PlanSpec, plan_launches

    staging = TransportSpec(**spec).staging_bytes
    elem = torch.empty((), dtype=shape.torch_dtype).element_size()
    ps = PlanSpec("torch_dist", shape.layers, shape.block_size, shape.kv_heads, shape.head_dim, shape.dtype, elem, staging)
    return {"launches": len(plan_launches(ps, tokens // shape.block_size)), "staging_MiB": staging / (1 << 20)}


def measure_prefill(sizes, device="cuda:0") -> dict[int, float]:
    """8B-shape prefill seconds per prompt length (random weights, eager, one prompt per forward)."""
    from cluster.kv.kv_cache import KVCacheSpec
    from cluster.model.loader import random_model
    from cluster.engine.model_runner import ModelRunner, PrefillChunk
    from benchmarks.common import arch_of

    arch = arch_of("llama-8b-shape")
    model = random_model(arch, torch.bfloat16, device)
    spec = KVCacheSpec.for_model(arch, 16, max(sizes) // 16 + 2, torch.bfloat16)
    runner = ModelRunner(model, spec, device)
    out = {}
    for n in sizes:
        chunk = [PrefillChunk(list(range(1, n + 1)), 0, list(range(1, n // 16 + 1)))]
        out[n] = _time(lambda: runner.prefill(chunk), reps=3)
    del runner, model
    torch.cuda.empty_cache()
    return out


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in sorted({r["path"] for r in rows}):
        rs = [r for r in rows if r["path"] == p]
        ax.plot([r["prompt_tokens"] for r in rs], [r["GBps"] for r in rs], marker="o", label=f"{p} (ready -> decode has it)")
        if "copy_kernel_GBps" in rs[0]:
            ax.plot([r["prompt_tokens"] for r in rs], [r["copy_kernel_GBps"] for r in rs], ls=":", marker=".", label=f"{p} copy kernel")
        if "baseline_GBps" in rs[0]:
            ax.plot([r["prompt_tokens"] for r in rs], [r["baseline_GBps"] for r in rs], ls="--", marker=".", label="send/recv of one buffer")
    rs = [r for r in rows if r["path"] == rows[0]["path"]]
    ax.plot([r["prompt_tokens"] for r in rs], [r["copy_GBps"] for r in rs], ls="--", color="k", label="D2D copy (same bytes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s (bytes moved once)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_rows(rows) -> None:
    print(f"{'path':11} {'tokens':>6} {'MB':>8} {'ms':>8} {'served':>8} {'commit>':>8} {'ready>':>8} {'send ms':>8} "
          f"{'GB/s':>8} {'copy':>8} {'kernel':>8} {'%copy':>6} {'ttft%':>6} exact")
    for r in rows:
        print(f"{r['path']:11} {r['prompt_tokens']:6d} {r['bytes'] / 1e6:8.1f} {r['seconds'] * 1e3:8.3f} "
              f"{r.get('served_transfer_s', 0) * 1e3:8.3f} {r.get('commit_to_arrival_s', 0) * 1e3:8.3f} "
              f"{r.get('kv_ready_to_arrival_s', 0) * 1e3:8.3f} "
              f"{r['send_s'] * 1e3:8.3f} {r['GBps']:8.1f} {r['copy_GBps']:8.1f} {r.get('copy_kernel_GBps', 0):8.1f} "
              f"{100 * r['GBps'] / r['copy_GBps']:6.1f} {100 * r.get('ttft_transfer_share', 0):6.2f} {r['exact']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="same_gpu")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--device", default="cuda:0", help="prefill device (and decode's, except for nccl paths)")
    ap.add_argument("--decode-device", default="cuda:0")
    ap.add_argument("--shape", default="llama-8b", choices=sorted(KV_SHAPES))
    ap.add_argument("--no-prefill", action="store_true", help="skip timing the 8B prefill (no TTFT share)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo, tiny KV shape, short sizes, no prefill")
    ap.add_argument("--out", default="loadtest/results")
    ap.add_argument("--name", default="transfer_h200")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.paths, args.device, args.decode_device, args.shape, args.no_prefill = "gloo", "cpu", "cpu", "tiny", True
        if args.sizes == ",".join(map(str, SIZES)):
            args.sizes = "32,256"
    sizes = [int(s) for s in args.sizes.split(",")]
    shape = KV_SHAPES[args.shape]
    results = [run_path(p, sizes, args.device, args.decode_device if p.startswith("nccl") else args.device, shape,
                        quick=args.dry_run) for p in args.paths.split(",")]
    rows = [r for res in results for r in res["rows"]]
    prefill = {} if args.no_prefill else measure_prefill(sizes, args.device)
    for r in rows:
        if r["prompt_tokens"] in prefill:
            pf = prefill[r["prompt_tokens"]]
            r["prefill_s"] = pf
            r["ttft_transfer_share"] = r["seconds"] / (pf + r["seconds"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "kv_shape": args.shape + " " + shape.describe(), "shape": asdict(shape), "rows": rows,
           "errors": {res["path"]: res.get("error") or res.get("errors", [])[:5] for res in results},
           "connect_s": {res["path"]: res.get("connect_s") for res in results},
           "specs": {res["path"]: res.get("spec") for res in results},
           "command": "python " + " ".join(sys.argv)}
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    if rows:
        plot(rows, out / f"{args.name}.png")
    print_rows(rows)
    for res in results:
        if res.get("error") or res.get("errors"):
            errs = res.get("error") or res.get("errors")
            print("ERRORS", res["path"], (errs if isinstance(errs, str) else "; ".join(errs[:3]))[:2000])
    return doc


if __name__ == "__main__":
    main()
