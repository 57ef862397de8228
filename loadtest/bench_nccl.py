"""NCCL GPU-to-GPU KV transfer (issue 9, needs 2 GPUs): prefill on cuda:0, decode on cuda:1.

Runs pdserve's torch_dist transport over NCCL (and host-staged gloo for contrast) through
bench_transfer, then, in the same run, a plain `torch.distributed` send/recv of one contiguous
buffer of the same size between the same two GPUs: the baseline the transport is judged against.
Writes nccl_h200x2.json (rows: path, prompt_tokens, bytes, seconds, GBps, baseline_GBps, exact) and a plot.

    python loadtest/bench_nccl.py --out loadtest/results
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from loadtest.bench_transfer import BS, HD, KVH, L, SIZES  # noqa: E402
from loadtest.bench_transfer import main as transfer_main  # noqa: E402


def _baseline_proc(rank: int, port: int, sizes, q):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for n in sizes:
        nbytes = n // BS * L * 2 * BS * KVH * HD * 2
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        times = []
        for rep in range(12):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
            torch.cuda.synchronize()
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        times.sort()
        out[n] = (nbytes, times[len(times) // 2])
    if rank == 1:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def baseline(sizes) -> dict[int, tuple[int, float]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_baseline_proc, args=(r, port, sizes, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="loadtest/results")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--paths", default="nccl", help="nccl, and gloo for the host-staged path")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        sys.exit("bench_nccl needs 2 GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    sizes = [int(s) for s in args.sizes.split(",")]
    doc = transfer_main(["--paths", args.paths, "--device", "cuda:0", "--decode-device", "cuda:1", "--no-prefill",
                         "--sizes", args.sizes, "--out", args.out, "--name", "nccl_h200x2"])
    base = baseline(sizes)
    for r in doc["rows"]:
        nbytes, sec = base[r["prompt_tokens"]]
        r["baseline_GBps"] = nbytes / sec / 1e9
        r["baseline_seconds"] = sec
    doc["baseline"] = "torch.distributed NCCL send/recv of one contiguous bf16 buffer of the same bytes, cuda:0 -> cuda:1"
    doc["command"] = "python loadtest/bench_nccl.py " + " ".join(argv or sys.argv[1:])
    Path(args.out, "nccl_h200x2.json").write_text(json.dumps(doc, indent=1))
    print(f"{'path':6} {'tokens':>6} {'GB/s':>8} {'baseline':>9} {'%':>6} exact")
    for r in doc["rows"]:
        print(f"{r['path']:6} {r['prompt_tokens']:6d} {r['GBps']:8.1f} {r['baseline_GBps']:9.1f} "
              f"{100 * r['GBps'] / r['baseline_GBps']:6.1f} {r['exact']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
