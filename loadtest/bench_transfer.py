"""KV transfer benchmark for the Llama-3.1-8B KV shape (bf16, 32 layers, 8 KV heads, head_dim 128).

Per path (same_gpu: CUDA IPC write into the decode pool; gloo: host-staged torch.distributed; nccl: GPU
to GPU, needs 2 GPUs) and prompt length: bytes, seconds (prefill-side `send`, claim to landed), GB/s,
the plain device-to-device copy bandwidth of the same bytes measured in the same run (copy_GBps), and
the share of TTFT spent in transfer (8B-shape prefill timed with random weights, unless --no-prefill).
Prefill and decode run in two processes (torch.multiprocessing spawn) sharing one TCPStore; no Ray.

    python loadtest/bench_transfer.py --out loadtest/results            # one GPU: same_gpu + gloo
    python loadtest/bench_transfer.py --paths nccl --decode-device cuda:1  # two GPUs (bench_nccl.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.messages import KVHeader, Reservation  # noqa: E402
from cluster.transport.control import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from cluster.transport.same_gpu import copy_blocks  # noqa: E402

L, KVH, HD, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


def block_sums(cache: torch.Tensor, blocks: list[int]) -> list[int]:
    b = cache[:, :, blocks].contiguous().view(torch.int16).to(torch.int64)
    return b.transpose(0, 2).reshape(len(blocks), -1).sum(-1).tolist()


def _cache(num_blocks: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((L, 2, num_blocks, BS, KVH, HD), generator=g, device=device, dtype=torch.float32).to(DTYPE)


def _plan(sizes, reps):
    """(seq, tokens, rep) for every transfer, identical on both sides; dst blocks are 1..n (contiguous)."""
    out, seq = [], 0
    for n in sizes:
        for r in range(reps(n) + 1):  # +1 warm-up
            out.append((seq, n, r))
            seq += 1
    return out


def _reps(path):
    return (lambda n: 3 if n >= 4096 else 5) if path == "gloo" else (lambda n: 20 if n <= 2048 else 10)


def decode_proc(spec_d: dict, device: str, sizes, path, q):
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    spec = TransportSpec(**spec_d)
    nb = max(sizes) // BS + 2
    pool = torch.zeros((L, 2, nb, BS, KVH, HD), dtype=DTYPE, device=device)
    t = create_transport(spec, pool, "d0", "decode")
    plan = _plan(sizes, _reps(path))
    for seq, n, _ in plan:
        blocks = list(range(1, n // BS + 2))
        t.expect(Reservation(f"r{seq}", "d0", tuple(blocks), seq), "p0")
    got, sums, deadline = 0, {}, time.monotonic() + 300
    while got < len(plan) and time.monotonic() < deadline:
        for a in t.poll_arrivals():
            got += 1
            if a.error:
                q.put(("error", f"decode: {a.reservation.request_id}: {a.error}"))
            seq = a.reservation.transfer_seq
            n = plan[seq][1]
            if plan[seq][2] == 1:  # first measured rep of each size: check exactness
                sums[n] = block_sums(pool, list(a.reservation.block_ids[: n // BS]))
        time.sleep(0.0005)
    q.put(("decode_sums", sums))
    q.put(("decode_metrics", {k: v for k, v in t.metrics().items() if k != "recent"}))
    time.sleep(1.0)
    t.close()


def prefill_proc(spec_d: dict, device: str, sizes, path, q):
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    spec = TransportSpec(**spec_d)
    nb = max(sizes) // BS + 2
    src = _cache(nb, device, seed=1)
    t = create_transport(spec, src, "p0", "prefill")
    rows, sums = [], {}
    for seq, n, rep in _plan(sizes, _reps(path)):
        blocks = list(range(1, n // BS + 1))
        dst = tuple(range(1, n // BS + 2))
        if rep == 1:
            sums[n] = block_sums(src, blocks)
        if src.is_cuda:
            torch.cuda.synchronize()
        st = t.send(Reservation(f"r{seq}", "d0", dst, seq), KVHeader(f"r{seq}", seq, n, 7), blocks, 60.0)
        if rep > 0:
            rows.append((n, st.bytes, st.seconds))
    # The copy ceiling for the same bytes, in this process, same run: a plain contiguous D2D copy.
    copy = {}
    for n in sizes:
        nbytes = n // BS * L * 2 * BS * KVH * HD * 2
        a = torch.empty(nbytes // 2, dtype=DTYPE, device=device).normal_()
        b = torch.empty_like(a)
        copy[n] = nbytes / _time_cuda(lambda: b.copy_(a))
    kernel = {}
    if path == "same_gpu":  # the transport's copy kernel alone (no control plane), into our own cache
        dst_cache = torch.empty_like(src)
        for n in sizes:
            ids = list(range(1, n // BS + 1))
            kernel[n] = n // BS * t.bytes_per_block / _time_cuda(lambda: copy_blocks(dst_cache, ids, src, ids))
    q.put(("prefill", rows, sums, copy, kernel))
    time.sleep(0.5)
    t.close()


def _time_cuda(fn, reps=20) -> float:
    """Median seconds of fn(), timed with CUDA events (perf_counter on CPU, for smoke runs)."""
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


def run_path(path: str, sizes, prefill_device="cuda:0", decode_device="cuda:0") -> dict:
    store = start_store("127.0.0.1", 0)
    kind = "same_gpu" if path == "same_gpu" else "torch_dist"
    spec = dict(kind=kind, store_host="127.0.0.1", store_port=store.port, backend="nccl" if path == "nccl" else "gloo",
                namespace=f"bench-{path}-{os.getpid()}", transfer_timeout_s=60.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=decode_proc, args=(spec, decode_device, sizes, path, q)),
             ctx.Process(target=prefill_proc, args=(spec, prefill_device, sizes, path, q))]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + 400
    while len(out) < 3 and time.monotonic() < deadline and any(p.is_alive() for p in procs) or not q.empty():
        try:
            msg = q.get(timeout=1.0)
        except Exception:
            continue
        if msg[0] == "error":
            errors.append(msg[1])
        else:
            out[msg[0]] = msg[1:]
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if "prefill" not in out:
        return {"path": path, "error": "; ".join(errors) or f"exit codes {[p.exitcode for p in procs]}", "rows": []}
    rows_raw, psums, copy, kernel = out["prefill"]
    dsums = out.get("decode_sums", ({},))[0]
    exact = {n: psums.get(n) == dsums.get(n) for n in sizes}
    rows = []
    for n in sizes:
        ss = sorted(s for m, _, s in rows_raw if m == n)
        nbytes = next(b for m, b, _ in rows_raw if m == n)
        sec = ss[len(ss) // 2]
        row = {"path": path, "prompt_tokens": n, "bytes": nbytes, "seconds": sec, "GBps": nbytes / sec / 1e9,
               "copy_GBps": copy[n] / 1e9, "exact": exact[n], "reps": len(ss)}
        if n in kernel:
            row["copy_kernel_GBps"] = kernel[n] / 1e9
        rows.append(row)
    return {"path": path, "rows": rows, "errors": errors}


def measure_prefill(sizes, device="cuda:0") -> dict[int, float]:
    """8B-shape prefill seconds per prompt length (random weights, eager, one prompt per forward)."""
    from cluster.kv_cache import KVCacheSpec
    from cluster.model.config import ModelArchConfig
    from cluster.model.loader import random_model
    from cluster.model_runner import ModelRunner, PrefillChunk

    cfg = ModelArchConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                          max_position_embeddings=131072, rope_theta=500000.0, dtype="bfloat16")
    model = random_model(cfg, DTYPE, device)
    spec = KVCacheSpec.for_model(cfg, BS, max(sizes) // BS + 2, DTYPE)
    runner = ModelRunner(model, spec, device)
    out = {}
    for n in sizes:
        chunk = [PrefillChunk(list(range(1, n + 1)), 0, list(range(1, n // BS + 1)))]
        out[n] = _time_cuda(lambda: runner.prefill(chunk), reps=3)
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
        ax.plot([r["prompt_tokens"] for r in rs], [r["GBps"] for r in rs], marker="o", label=f"{p} (send, end to end)")
        if "copy_kernel_GBps" in rs[0]:
            ax.plot([r["prompt_tokens"] for r in rs], [r["copy_kernel_GBps"] for r in rs], ls=":", marker=".", label=f"{p} copy kernel")
    rs = [r for r in rows if r["path"] == rows[0]["path"]]
    ax.plot([r["prompt_tokens"] for r in rs], [r["copy_GBps"] for r in rs], ls="--", color="k", label="D2D copy (same bytes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (Llama-3.1-8B KV shape, bf16)")
    ax.set_ylabel("GB/s (bytes moved once)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="same_gpu,gloo")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--decode-device", default="cuda:0")
    ap.add_argument("--device", default="cuda:0", help="prefill device (and decode's, except for nccl)")
    ap.add_argument("--no-prefill", action="store_true", help="skip timing the 8B prefill (no TTFT share)")
    ap.add_argument("--out", default="loadtest/results")
    ap.add_argument("--name", default="transfer_h200")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = [run_path(p, sizes, args.device, args.decode_device if p == "nccl" else args.device) for p in args.paths.split(",")]
    rows = [r for res in results for r in res["rows"]]
    prefill = {} if args.no_prefill else measure_prefill(sizes, args.device)
    for r in rows:
        if r["prompt_tokens"] in prefill:
            pf = prefill[r["prompt_tokens"]]
            r["prefill_s"] = pf
            r["ttft_transfer_share"] = r["seconds"] / (pf + r["seconds"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "kv_shape": "Llama-3.1-8B bf16 L32 kvh8 hd128 bs16",
           "rows": rows, "errors": {res["path"]: res.get("error") or res.get("errors", [])[:5] for res in results},
           "command": "python " + " ".join(sys.argv)}
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    if rows:
        plot(rows, out / f"{args.name}.png")
    print(f"{'path':9} {'tokens':>6} {'MB':>8} {'ms':>8} {'GB/s':>8} {'copy':>8} {'kernel':>8} {'%copy':>6} {'ttft%':>6} exact")
    for r in rows:
        print(f"{r['path']:9} {r['prompt_tokens']:6d} {r['bytes'] / 1e6:8.1f} {r['seconds'] * 1e3:8.3f} {r['GBps']:8.1f} "
              f"{r['copy_GBps']:8.1f} {r.get('copy_kernel_GBps', 0):8.1f} {100 * r['GBps'] / r['copy_GBps']:6.1f} "
              f"{100 * r.get('ttft_transfer_share', 0):6.2f} {r['exact']}")
    for res in results:
        if res.get("error") or res.get("errors"):
            errs = res.get("error") or res.get("errors")
            print("ERRORS", res["path"], (errs if isinstance(errs, str) else "; ".join(errs[:3]))[:2000])
    return doc


if __name__ == "__main__":
    main()
