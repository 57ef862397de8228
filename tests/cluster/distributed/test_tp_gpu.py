"""Tensor parallelism on two GPUs of one host (skipped with fewer): the one-shot all-reduce (symmetric
memory) equals NCCL's sum and replays inside a CUDA graph; the TP-2 engine's greedy output equals the
one-GPU engine's on the Triton path; a TP-2 decode worker replaying CUDA graphs (the all-reduces and the
logits gather inside them) equals the engine; multicast stays off."""

import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.device_count() < 2:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="needs two GPUs")]


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in lengths]


def _one_shot_rank(rank, port, q):
    import datetime

    import torch.distributed as dist

    from cluster.distributed.communicator import ONE_SHOT_MAX_BYTES, OneShotAllReduce, TPCommunicator
    from cluster.distributed.tp_group import _disable_multicast

    _disable_multicast()
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
    dev = torch.device("cuda", rank)
    one = OneShotAllReduce(dev, torch.bfloat16, ONE_SHOT_MAX_BYTES[2])
    comm = TPCommunicator(rank, 2, dev, one)
    out = {}
    for n in (4096, 64 * 4096, ONE_SHOT_MAX_BYTES[2] // 2):
        x = torch.randn(n, dtype=torch.bfloat16, device=dev, generator=torch.Generator(dev).manual_seed(rank + n))
        ref = x.clone()
        dist.all_reduce(ref)
        got = comm.all_reduce(x.clone())
        assert comm.path(x) == "one_shot"
        # In a graph, replayed: the same sums.
        static = x.clone()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = comm.all_reduce(static)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        out[n] = (torch.equal(got, ref) or bool(torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)),
                  torch.equal(y, got))
    q.put((rank, out, os.environ.get("NCCL_NVLS_ENABLE"), os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")))
    dist.destroy_process_group()


def test_one_shot_all_reduce_equals_nccl_and_replays_in_a_graph():
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_one_shot_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    for rank, out, nvls, mc in got:
        assert (nvls, mc) == ("0", "1")
        for n, (close, replayed) in out.items():
            assert close and replayed, (rank, n)


def test_tp2_engine_equals_one_gpu_engine(demo_model_dir):
    from cluster.engine.engine import LLMEngine
    from cluster.sampling.sampling_params import SamplingParams

    prompts = _prompts(0, [1, 9, 64, 157, 300])
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tp2 = LLMEngine(demo_model_dir, dtype="float32", device="cuda:0", attention_backend="triton", tensor_parallel_size=2)
    try:
        out2 = tp2.generate(prompts, sp)
        assert tp2.group.comm.one_shot is not None  # the symmetric-memory path was set up
    finally:
        tp2.close()
    tp1 = LLMEngine(demo_model_dir, dtype="float32", device="cuda:0", attention_backend="triton")
    assert [o.token_ids for o in out2] == [o.token_ids for o in tp1.generate(prompts, sp)]


def test_tp2_decode_worker_with_graphs_equals_the_engine(demo_model_dir):
    sys.path.insert(0, str(Path(__file__).parents[2] / "decode_worker"))
    from test_decode_worker import Collector

    from cluster.distributed.rank_launcher import ProcessRankLauncher
    from cluster.engine.engine import LLMEngine
    from cluster.wire.messages import GenerateRequest
    from cluster.sampling.sampling_params import SamplingParams
    from cluster.worker.worker_config import WorkerConfig
    from cluster.engine.worker_model import lead_group
    from decode_worker.decode_worker import DecodeWorker
    from decode_worker.rank_follower import run_decode_rank

    prompts = _prompts(1, [5, 130, 20, 70])
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", device="cuda:0", attention_backend="triton",
                       max_num_seqs=8, graph_buckets=(1, 2, 4, 8), num_blocks=256, tensor_parallel_size=2)
    launcher = ProcessRankLauncher(run_decode_rank, "d0", cfg)
    failures = []
    worker = DecodeWorker("d0", cfg, group=lead_group(cfg, launcher.launch, on_failure=failures.append))
    try:
        assert worker.graph_runner.use_cuda_graph and worker.graph_runner.num_captures == 8
        col = Collector(worker)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            worker.submit_local(GenerateRequest(f"r{i}", tuple(p), sp, 9, time.time()))
        col.wait(lambda: len(col.finish) == len(prompts), stall_s=300)
        m = worker.step_metrics()
        assert m["steps_total"] > m["eager_steps_total"]  # graph replays, with the collectives inside
    finally:
        worker.shutdown()
    assert launcher.join(60) == [0] and failures == []
    engine = LLMEngine(demo_model_dir, dtype="float32", device="cuda:0", attention_backend="triton")
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        s = engine.add_request(p, sp, f"r{i}")
        s.seed = 9
        seqs.append(s)
    while engine.has_work():
        engine.step()
    for i, s in enumerate(seqs):
        assert col.tokens[f"r{i}"] == list(s.output_token_ids), f"request {i}"
