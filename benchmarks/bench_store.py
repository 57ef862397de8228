"""The KV rendezvous store's own process (cluster/transport/store_process.py): what it costs, and which
keys a pair's c10d rendezvous really writes into it.

1. start: the child's CPU seconds up to listening and the wall seconds until the launcher has its
   port (each cluster start pays it, off the critical path: deploy/serving_cluster.py);
2. sweep: the warden's cost per key over a store of sealed entries (one process: both ends);
3. pair: two ranks (processes) form a gloo or NCCL pair through the sealed store, as torch_dist.py
   does (prefix `{ns}/pg/P.i/D.j/gG/L0/`), and move a tensor, while the warden sweeps every 5 ms;
   then every key in the store is listed with the warden's judgment. `ok` is false (exit 1) if the
   warden would touch a key the rendezvous wrote or the bytes did not arrive. NCCL needs 2 GPUs.

    python -m benchmarks.bench_store --backend nccl --out loadtest/results/store_nccl_h200.json   # 2 GPUs
    python -m benchmarks.bench_store --dry-run        # gloo, few iterations (the test suite runs it)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

SECRET = b"b" * 32


def measure_start(n: int) -> dict:
    from cluster.transport.store_process import StoreProcess

    cpu, wall = [], []
    for _ in range(n):
        sp = StoreProcess.start("127.0.0.1", 0, secret=SECRET, namespace="bench")
        sp.wait_ready(240)  # measured, not bounded: a starved dry run (the test run's nice-10 stream) may take minutes
        cpu.append(sp.startup["cpu_s"])
        wall.append(round(sp.startup["wall_s"], 3))
        sp.stop()
    return {"runs": n, "cpu_s": cpu, "wall_s": wall, "cpu_s_median": statistics.median(cpu),
            "wall_s_median": statistics.median(wall)}


def measure_sweep(keys: int) -> dict:
    import torch.distributed as dist

    from cluster.transport.authenticated_store import AuthenticatedStore
    from cluster.transport.rendezvous_store import start_store
    from cluster.transport.store_warden import StoreWarden

    master = start_store("127.0.0.1", 0)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False, use_libuv=True,
                           timeout=datetime.timedelta(seconds=30))
    sealed = AuthenticatedStore(client, SECRET)
    for i in range(keys):
        sealed.set(f"bench/hb/w{i}", b"\x92\x01" + b"x" * 100)
    warden, best_wall, best_cpu = StoreWarden("bench", SECRET), float("inf"), float("inf")
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        r = warden.sweep(client)
        best_wall, best_cpu = min(best_wall, time.perf_counter() - w0), min(best_cpu, time.process_time() - c0)
        assert (r.deleted, r.tombstoned) == (0, 0)
    return {"keys": keys, "wall_us_per_key": round(best_wall / keys * 1e6, 2),
            "cpu_us_per_key_both_ends": round(best_cpu / keys * 1e6, 2)}


def _rank(r: int, backend: str, port: int, ns: str, out) -> None:
    import torch
    import torch.distributed as dist

    from cluster.transport.authenticated_store import AuthenticatedStore

    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=True,
                        timeout=datetime.timedelta(seconds=60))
    store = AuthenticatedStore(raw, SECRET).prefixed(f"{ns}/pg/p.1/d.1/g0/L0/")
    if backend == "nccl":
        device = torch.device("cuda", r)
        torch.cuda.set_device(device)
        pg = dist.ProcessGroupNCCL(store, r, 2)
    else:
        device = torch.device("cpu")
        pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=60))
    t = torch.arange(1024.0, device=device) if r == 0 else torch.zeros(1024, device=device)
    for _ in range(3):
        (pg.send if r == 0 else pg.recv)([t], 1 - r, 0).wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out.put((r, bool(torch.equal(t.cpu(), torch.arange(1024.0))), store.rejected))


def check_pair(backend: str) -> dict:
    import multiprocessing as mp

    from cluster.transport.store_process import StoreProcess
    from cluster.transport.store_warden import StoreWarden

    ns = "bench-pair"
    sp = StoreProcess.start("127.0.0.1", 0, secret=SECRET, namespace=ns, sweep_s=0.005)
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, backend, sp.wait_ready(), ns, out)) for r in range(2)]
        [p.start() for p in procs]
        got = sorted(out.get(timeout=300) for _ in procs)
        [p.join(60) for p in procs]
        client, warden = sp.client(), StoreWarden(ns, SECRET)
        rows = []
        for key in sorted(client.list_keys()):
            value = client.get(key)
            action, _ = warden.judge(key, value)
            rows.append({"key": key, "bytes": len(value), "warden": action.value})
        stats = sp.stats()
    finally:
        sp.stop()
    ok = all(arrived for _, arrived, _ in got) and all(r["warden"] == "keep" for r in rows) and \
        stats.get("tombstoned", 0) == 0 and stats.get("deleted", 0) == 0 and stats.get("errors", 0) == 0
    return {"backend": backend, "keys": rows, "ranks": [{"rank": r, "arrived": a, "rejected": n} for r, a, n in got],
            "warden": stats, "ok": ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--dry-run", action="store_true", help="few iterations (gloo unless --backend nccl)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = {"host": platform.node(), "python": sys.version.split()[0],
              "start": measure_start(1 if args.dry_run else 5),
              "sweep": measure_sweep(50 if args.dry_run else 2000),
              "pair": check_pair(args.backend)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result["pair"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
