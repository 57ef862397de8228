"""Tensor-parallel benchmarks on the GPUs of one host (issue 25, item 5), each with a CPU dry run
(--dry-run: gloo, the tiny shape, the same code in seconds):

  decode     the decode step of a TP-N worker (one CUDA graph per bucket, the two all-reduces per layer
             and the logits all-gather inside it; rank 0 drives the decode worker's own scheduler and
             graph runner, the followers replay what it announces) against its memory floor: bytes one
             rank reads per step (its weights, its KV heads) over the copy bandwidth measured on its GPU.
             8B shape at batch 1 and 64, a 70B shape at batch 1 (target: <= 1.3x the floor); TP-1 rows
             of the 8B shape on rank 0's GPU beside them.
  allreduce  the two all-reduce paths (symmetric-memory one-shot, NCCL) per message size, each timed as
             50 calls replayed in a CUDA graph: where one-shot stops winning is where the rule's
             threshold (cluster/distributed/communicator.ONE_SHOT_MAX_BYTES) should be.

The floor counts what a step must read: every decoder weight of the rank, its share of the LM head,
the norms, and its KV heads' cache for each row's context; not the embedding (a step reads one row per
token of it). Rows: {bench, shape, tp, batch_size, step_ms, floor_ms, ratio, bytes_per_rank, one_shot}.

    python -m benchmarks.bench_tp decode allreduce --tp 2 --out loadtest/results/tp_h200.json
    python -m benchmarks.bench_tp decode allreduce --dry-run --out /tmp/tp.json      # CPU
Results merge into --out by bench (rows of the benches not run are kept).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cluster.distributed.follower import RankFollower
from cluster.distributed.rank_launcher import ProcessRankLauncher
from cluster.distributed.step_messages import DecodeStep
from cluster.distributed.tp_group import TPGroup
from cluster.kv.kv_cache import KVCacheSpec
from cluster.model.loader import random_model
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from cluster.engine.worker_model import tensor_parallel
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeScheduler
from benchmarks.common import arch_of, copy_bandwidth_gbps

PROMPT_LEN = 512
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
# shape -> batch sizes measured (the issue's: 8B at 1 and 64, 70B at 1).
GPU_PLAN = {"llama-8b-shape": (1, 64), "llama-70b-shape": (1,)}
DRY_PLAN = {"tiny-shape": (1, 2)}
SHAPE_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "factor": 8.0})
ALLREDUCE_BYTES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)


def log(*a):
    print(*a, flush=True)


def _arch(shape: str):
    if shape == "llama-70b-shape":
        from benchmarks import common

        common.SHAPES.setdefault(shape, SHAPE_70B)
    return arch_of(shape)


def _device(opts: dict, rank: int) -> torch.device:
    return torch.device("cuda", rank) if opts["cuda"] else torch.device("cpu")


class DecodeRig:
    """One rank's model, KV cache and captured graphs for one shape: built the same way on every rank
    (their capture's collectives pair up)."""

    def __init__(self, shape: str, batches, group, device: torch.device):
        self.shape, self.group, self.device = shape, group, device
        self.arch = arch = _arch(shape)
        cuda = device.type == "cuda"
        dtype = torch.bfloat16
        torch.manual_seed(0)
        self.model = random_model(arch, dtype, device, attention_backend="triton" if cuda else "torch",
                                  tp=tensor_parallel(group, arch))
        per_seq = -(-(PROMPT_LEN + 64) // BLOCK_SIZE)
        self.spec = KVCacheSpec.for_model(arch, BLOCK_SIZE, max(batches) * per_seq + 2, dtype, self.model.num_kv_heads)
        self.kv = torch.empty(self.spec.shape, dtype=dtype, device=device).normal_()  # never time on zeros
        self.model.bind_kv_cache(self.kv)
        self.runner = BucketedGraphRunner(self.model, self.kv, BLOCK_SIZE, max(batches),
                                          max_blocks_per_seq=MAX_MODEL_LEN // BLOCK_SIZE, buckets=tuple(batches),
                                          use_cuda_graph=cuda, group=group)
        self.runner.capture(progress=False)

    def bytes_per_step(self, bs: int) -> int:
        """What one rank reads per step (the module docstring's floor)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied LM head counts as read
        params.pop("embed_tokens.weight")
        read = sum(p.numel() * p.element_size() for p in params.values())
        kv_token = 2 * self.arch.num_layers * self.model.num_kv_heads * self.arch.head_dim * 2
        return read + bs * PROMPT_LEN * kv_token

    def step_times(self, bs: int, steps: int) -> list[float]:
        """Device seconds per step (rank 0): the decode worker's pipelined loop, step t+1 launched
        before step t's tokens are read."""
        sched = DecodeScheduler(BlockManager(self.spec.num_blocks, BLOCK_SIZE), bs, 4096, MAX_MODEL_LEN)
        for i in range(bs):
            s = Sequence(f"r{i}", [(7 * k + i) % self.arch.vocab_size for k in range(PROMPT_LEN)],
                         SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True), seed=i)
            assert sched.reserve(s)
            sched.on_arrival(s.request_id, 7, ok=True)
        times, inflight = [], None
        for step in range(steps + 1):
            launched = None
            if step < steps:
                batch = sched.schedule_decode(step, pipeline_busy=inflight is not None)
                launched = (batch, self.runner.launch(batch.rows))
                sched.on_step_launched(batch)
            if inflight is not None:
                b, h = inflight
                sched.on_step_output(b, h.tokens(), h.logprobs())
                times.append(h.gpu_time_s)
            inflight = launched
        return times[min(3, len(times) // 4):]

    def free(self) -> None:
        del self.runner, self.model, self.kv
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# -- all-reduce paths -------------------------------------------------------------------------------
def allreduce_rows(group, sizes, calls: int = 50) -> list[dict]:
    """Every rank runs this, in the same order (collectives). Per size and path: microseconds per call."""
    comm, dev = group.comm, group.device
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        for path in ("one_shot", "nccl") if dev.type == "cuda" else ("gloo",):
            if path == "one_shot" and (comm.one_shot is None or nbytes > comm.one_shot.max_bytes):
                continue
            op = comm.one_shot if path == "one_shot" else (lambda t: (torch.distributed.all_reduce(t), t)[1])
            ok = bool(torch.all(op(x.clone()) == group.size))  # eager, once: the sum is right
            if dev.type == "cuda":
                scratch = x.clone()  # NCCL reduces in place: its values grow over the calls, its time does not
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(calls):
                        op(scratch)
                g.replay()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1e3 / calls
                del g, scratch
            else:
                t0 = time.perf_counter()
                for _ in range(5):
                    op(x.clone())
                us = (time.perf_counter() - t0) / 5 * 1e6
            rows.append({"bench": "allreduce", "tp": group.size, "bytes": nbytes, "path": path, "us": round(us, 2),
                         "correct": ok})
    return rows


# -- ranks -----------------------------------------------------------------------------------------
def follower_main(rank: int, rendezvous, opts: dict) -> None:
    """A follower of the benchmark's group: the same all-reduces, then every shape's announced steps."""
    group = TPGroup.follower(rendezvous, rank, _device(opts, rank), torch.bfloat16)
    if "allreduce" in opts["benches"]:
        allreduce_rows(group, opts["sizes"])
    if "decode" in opts["benches"]:
        for shape, batches in opts["plan"].items():
            rig = DecodeRig(shape, batches, group, group.device)
            RankFollower(group, {DecodeStep: rig.runner.replay_step}).run()  # until rank 0's Stop("next")
            rig.free()
    RankFollower(group, {}).run()  # the final Stop
    group.close()


def run(opts: dict, tp: int, out_rows: list, save) -> None:
    from cluster.distributed.step_messages import Stop

    dev0 = _device(opts, 0)
    if "decode" in opts["benches"] and opts["tp1"]:  # TP-1 rows first, on rank 0's GPU alone
        for shape, batches in opts["plan"].items():
            if shape == "llama-70b-shape":
                continue  # 141 GB of bf16 weights: not one GPU's
            rig = DecodeRig(shape, batches, None, dev0)
            _decode_rows(rig, batches, opts, out_rows, tp=1)
            rig.free()
            save()
    launcher = ProcessRankLauncher(follower_main, opts)
    group = TPGroup.leader(tp, dev0, torch.bfloat16, launcher.launch)
    try:
        if "allreduce" in opts["benches"]:
            rows = allreduce_rows(group, opts["sizes"])
            for r in rows:
                log(f"allreduce tp={tp} {r['bytes']:>8d} B {r['path']:8s} {r['us']:8.2f} us correct={r['correct']}")
            out_rows += rows
            save()
        if "decode" in opts["benches"]:
            for shape, batches in opts["plan"].items():
                rig = DecodeRig(shape, batches, group, dev0)
                _decode_rows(rig, batches, opts, out_rows, tp=tp, one_shot=group.comm.one_shot is not None)
                group.publish(Stop("next"))
                rig.free()
                save()
    finally:
        group.close()
        launcher.join(60)
        launcher.kill()


def _decode_rows(rig: DecodeRig, batches, opts, out_rows, tp: int, one_shot: bool = False) -> None:
    bw = opts["copy_gbps"]
    for bs in batches:
        times = rig.step_times(bs, opts["steps"])
        step_ms = statistics.median(times) * 1e3
        nbytes = rig.bytes_per_step(bs)
        floor_ms = nbytes / (bw * 1e9) * 1e3
        row = {"bench": "decode", "shape": rig.shape, "tp": tp, "batch_size": bs, "step_ms": round(step_ms, 4),
               "floor_ms": round(floor_ms, 4), "ratio": round(step_ms / floor_ms, 3), "bytes_per_rank": nbytes,
               "one_shot": one_shot, "graph": rig.runner.use_cuda_graph, "steps": len(times)}
        log(f"decode {rig.shape} tp={tp} bs={bs}: {step_ms:.3f} ms, floor {floor_ms:.3f} ms ({row['ratio']:.2f}x)")
        out_rows.append(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("benches", nargs="+", choices=["decode", "allreduce"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-tp1", action="store_true", help="skip the TP-1 rows of the 8B shape")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, the tiny shape")
    ap.add_argument("--out", default="loadtest/results/tp_h200.json")
    args = ap.parse_args(argv)
    cuda = not args.dry_run
    if cuda and torch.cuda.device_count() < args.tp:
        log(f"needs {args.tp} GPUs, this host has {torch.cuda.device_count()}")
        return 2
    opts = {"benches": args.benches, "cuda": cuda, "plan": GPU_PLAN if cuda else DRY_PLAN,
            "steps": args.steps if cuda else 4, "tp1": not args.no_tp1,
            "sizes": ALLREDUCE_BYTES if cuda else ALLREDUCE_BYTES[:2]}
    opts["copy_gbps"] = copy_bandwidth_gbps("cuda" if cuda else "cpu")
    out = Path(args.out)
    kept = []
    if out.exists():
        kept = [r for r in json.loads(out.read_text()).get("rows", []) if r.get("bench") not in args.benches]
    rows: list[dict] = []

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count() if cuda
                else 0, "torch": torch.__version__, "copy_gbps": round(opts["copy_gbps"], 1), "dry_run": args.dry_run,
                "finished_at": time.time()}
        out.write_text(json.dumps({"meta": meta, "rows": kept + rows}, indent=1))
    run(opts, args.tp, rows, save)
    save()
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
