"""KV transfer between two GPUs (prefill on cuda:0, decode on cuda:1) over NCCL: cost, interference,
and what it adds to TTFT. Writes nccl_h200x2.json (+ .png; --name renames both) with:

  rows          {path, prompt_tokens, bytes, seconds, kv_ready_to_arrival_s, GBps, baseline_GBps, of_baseline,
                exact, launches, ...} for 128..8192 tokens (8B KV shape), layer-wise shipping off.
                kv_ready_to_arrival_s: KV ready on the prefill side -> the decode process saw the
                arrival (the transfer time the targets read); seconds: the prefill done -> that arrival
                (what TTFT pays; bench_transfer.py defines every field). baseline: a plain
                torch.distributed send/recv of one contiguous buffer of the same bytes between the same
                GPUs. Paths: nccl (the default staging: one message per layer group of at most 32 MiB,
                gathered and scattered by the fused copy kernel), nccl_cold (the Begin not ahead of the
                KV), nccl_slot16m / nccl_slot64m (other slot sizes).
  decode_stall  a real DecodeWorker (1B shape, random weights, CUDA graphs) decoding a steady batch;
                decode step p50/p99 (device time of a step) with no transfers, with a stream of incoming
                transfers, and with layer-wise transfers (receives posted for a whole emulated forward).
  ttft_overlap  a real PrefillWorker (8B shape, random weights) prefilling one 2048-token prompt and
                shipping it to cuda:1: TTFT (submit -> the decode side has KV and first token) with
                layer-wise shipping off and on, against the same prefill without any transfer; share =
                (TTFT - prefill alone) / TTFT; share_in_run = (TTFT - the worker's own forward and
                first-token time in that run) / TTFT (the same path, so no warm-up or thread effects).
  staging       ONE GPU (stage "staging", not in the default set): the fused copy kernel as the staged
                payload runs it, per prompt length and slot size: a bundle's scattered blocks gathered
                into slots launch by launch, then scattered into other blocks; GB/s, the first gather
                and last scatter (what a pipelined transfer leaves exposed), host microseconds per
                launch (it must stay below a launch's wire time), exact.
  targets       the issue's targets, evaluated (not asserted): nccl >= 80 % of the baseline from 2048
                tokens, <= 0.3 ms at 128 tokens, decode step p99 with transfers <= 1.1x without.

    python benchmarks/bench_nccl.py --out loadtest/results     # two GPUs, NCCL_NVLS_ENABLE=0
    python benchmarks/bench_nccl.py --stages staging --name staging_h200 --out $OUT   # one GPU
    python benchmarks/bench_nccl.py --dry-run --out /tmp/x     # CPU: gloo, tiny shapes, short phases
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cluster.wire.messages import GenerateRequest, PrefillTask, Reservation, ReserveRequest  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.transport.base import KVSend  # noqa: E402
from cluster.transport.block_copy import copy_blocks  # noqa: E402
from cluster.transport.rendezvous_store import start_store  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from cluster.transport.plan import PlanSpec, plan_launches  # noqa: E402
from benchmarks.bench_transfer import KV_SHAPES, SIZES, KVShape, _device, _time, plot, print_rows, run_path  # noqa: E402
from loadtest.report import percentile  # noqa: E402


def log(*a):
    print(*a, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(store, ns: str, backend: str, **kw) -> dict:
    return dict(kind="torch_dist", store_host="127.0.0.1", store_port=store.port, backend=backend, secret=os.urandom(32),
                namespace=f"{ns}-{os.getpid()}-{time.monotonic_ns()}", transfer_timeout_s=60.0, **kw)


def _arch(name: str):
    """1B/8B shapes from bench_decode; "tiny" for CPU dry runs."""
    from cluster.model.config import ModelArchConfig
    from benchmarks.common import arch_of

    if name != "tiny":
        return arch_of(name)
    return ModelArchConfig.from_dict(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=1, dtype="float32"))


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


_TOKENIZER_VOCAB = 512  # the demo model's tokenizer, which the decode worker's publisher detokenizes with


def _request(rid: str, tokens: int, max_tokens: int, salt: int = 0) -> GenerateRequest:
    """A prompt of `tokens` ids; prompts of different salts (< 502) differ from their first token on,
    so no prefix cache holds one for another (every transfer moves its whole KV, every forward
    computes its whole prompt)."""
    ids = tuple((7 * i + 3 + 131 * salt) % (_TOKENIZER_VOCAB - 10) + 5 for i in range(tokens))
    return GenerateRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), 0, time.time())


def _decodable(model, vocab: int) -> None:
    """Rows past the tokenizer's vocabulary give logit 0 (as benchmarks/make_model.py writes them), so
    greedy decoding of random weights stays on ids the publisher can detokenize."""
    with torch.no_grad():
        model.embed_tokens.weight[vocab:] = 0
        model.lm_head.weight[vocab:] = 0


# -- 1. the baseline: one contiguous buffer, plain send/recv ---------------------------------------
def _baseline_proc(rank: int, port: int, sizes, shape: KVShape, backend: str, devices, q):
    dev = _device(devices[rank])
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for n in sizes:
        nbytes = shape.bytes_for(n)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        times = []
        for rep in range(12):
            dist.barrier()
            if buf.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
            if buf.is_cuda:
                torch.cuda.synchronize()
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        out[n] = (nbytes, sorted(times)[len(times) // 2])
    if rank == 1:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def baseline(sizes, shape: KVShape, backend: str, devices) -> dict[int, tuple[int, float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_baseline_proc, args=(r, port, sizes, shape, backend, devices, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return res


# -- 2. decode stall ---------------------------------------------------------------------------------
def _stall_decode_proc(spec_d, device, shape_name, tokenizer_dir, batch, phase_s, interval_s, tokens, ctl, q, go, done,
                       decode_gone):
    from cluster.model.loader import random_model
    from cluster.worker.worker_config import WorkerConfig
    from decode_worker.decode_worker import DecodeWorker
    from decode_worker.metrics import StepMetrics

    device = _device(device)
    cuda = device.startswith("cuda")
    arch, dtype = _arch(shape_name), _dtype(device)
    torch.manual_seed(0)
    model = random_model(arch, dtype, device, attention_backend="triton" if cuda else "torch")
    _decodable(model, _TOKENIZER_VOCAB)
    prompt_len, max_len = 512, 4096
    blocks = batch * (max_len // 16) + 8 * (tokens // 16 + 2) + 2
    cfg = WorkerConfig(model_dir=tokenizer_dir, device=device, num_blocks=blocks, max_num_seqs=batch + 16, graph_buckets=(batch,),
                       use_cuda_graph=cuda, max_model_len=max_len, max_prefill_tokens=4096)
    worker = DecodeWorker("d0", cfg, None, model=model, capture_progress=False)
    worker.metrics = StepMetrics(recent=1 << 18)  # every step of the run, not the last 256
    transport = create_transport(TransportSpec(**spec_d), worker.kv_cache, "d0", "decode")
    worker.attach_transport(transport)
    q.put(("decode_ready",))
    for i in range(batch):  # the running batch: long generations that never end during the run
        assert worker.submit_local(_request(f"run{i}", prompt_len, max_len - prompt_len - 1)) is not None
    while worker.stats().running < batch:
        worker.poll_token_batches(0.01)
    go.wait(600)  # the prefill process is connected (its start-up does not share the phases)
    time.sleep(1.0)  # settled: every step is a full batch
    rows, n = [], 0
    for mode in ("none", "transfers", "transfers_layerwise"):
        s0, t_end, sent, next_at = worker.metrics.steps, time.monotonic() + phase_s, 0, time.monotonic()
        while time.monotonic() < t_end:
            worker.poll_token_batches(0.0)
            if mode != "none" and time.monotonic() >= next_at:
                # max_tokens=1: the arrival finishes the request at once, the batch stays as it is
                res = worker.reserve(ReserveRequest(_request(f"x{n}", tokens, 1, salt=1 + n % 500), "p0"))
                if res is not None:
                    ctl.put((res, tokens, mode == "transfers_layerwise"))
                    sent, n = sent + 1, n + 1
                next_at += interval_s
            time.sleep(0.001)
        s1 = worker.metrics.steps
        recs = [r for r in worker.metrics.recent if s0 <= r.step < s1 and r.batch_size == batch]
        step = sorted(r.step_time_s for r in recs)
        host = sorted(r.host_time_s for r in recs)
        rows.append({"mode": mode, "steps": len(recs), "batch": batch, "transfers": sent, "transfer_tokens": tokens,
                     "interval_ms": interval_s * 1e3 if mode != "none" else None,
                     "step_p50_ms": 1e3 * percentile(step, 50), "step_p99_ms": 1e3 * percentile(step, 99),
                     "step_max_ms": 1e3 * step[-1], "host_p50_ms": 1e3 * percentile(host, 50),
                     "host_p99_ms": 1e3 * percentile(host, 99)})
        log(f"decode_stall {mode}: {rows[-1]}")
        time.sleep(0.5)  # the phase's last transfers land
    ctl.put(None)
    done.wait(120)  # every transfer resolved on the prefill side
    time.sleep(0.5)
    m = transport.metrics()
    q.put(("stall", rows, {k: v for k, v in m.items() if k != "recent"}, worker.error))
    worker.shutdown()
    decode_gone.set()


def _stall_prefill_proc(spec_d, device, shape_name, forward_ms, ctl, q, go, done, decode_gone):
    device = _device(device)
    arch = _arch(shape_name)
    nb = 8 * 4096 // 16
    src = torch.randn((arch.num_layers, 2, nb, 16, arch.num_kv_heads, arch.head_dim), device=device).to(_dtype(device))
    t = create_transport(TransportSpec(**spec_d), src, "p0", "prefill")
    t.connect(["d0"])
    per_layer = forward_ms / 1e3 / arch.num_layers
    cycles = None
    if src.is_cuda:  # GPU clock cycles per emulated layer: the compute stream busy, like a real forward
        probe = 10_000_000
        cycles = int(probe * per_layer / _time(lambda: torch.cuda._sleep(probe), reps=3))
    go.set()
    pending, failures, k = [], 0, 0
    while True:
        item = ctl.get()
        if item is None:
            break
        res, tokens, layerwise = item
        n = tokens // 16 - res.num_cached_blocks  # only what the decode worker lacks (none, by the salts)
        tokens -= 16 * res.num_cached_blocks
        blocks = tuple(range(1 + (k % 8) * (n + 1), 1 + (k % 8) * (n + 1) + n))
        k += 1
        sh = t.begin([KVSend(res, tokens, blocks)], layerwise=layerwise)
        if layerwise:  # the forward, emulated layer by layer: layer i ships while layer i+1 "computes"
            for i in range(arch.num_layers):
                if cycles is not None:
                    torch.cuda._sleep(cycles)
                else:
                    time.sleep(per_layer)
                sh.layer_done(i)
        sh.kv_done()
        sh.commit({res.request_id: 5})
        pending.append(sh.futures[res.request_id])
    why = []
    for f in pending:
        try:
            e = f.exception(timeout=60)
        except TimeoutError:
            e = TimeoutError("not done within 60 s")
        if e is not None:
            failures += 1
            why.append(f"{type(e).__name__}: {e}")
    done.set()
    q.put(("stall_prefill", failures, why[:3]))
    decode_gone.wait(120)  # the decode side read its transport's metrics and shut down: closing fails nothing it counts
    t.close()


def decode_stall(backend, devices, shape_name, batch, phase_s, interval_s, tokens, forward_ms) -> dict:
    from cluster.model.demo import ensure_demo_model

    tokenizer_dir = str(ensure_demo_model())
    store = start_store("127.0.0.1", 0)
    spec = _spec(store, "stall", backend)
    ctx = mp.get_context("spawn")
    q, ctl, go, done, decode_gone = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    dec = ctx.Process(target=_stall_decode_proc, args=(spec, devices[1], shape_name, tokenizer_dir, batch, phase_s,
                                                       interval_s, tokens, ctl, q, go, done, decode_gone))
    dec.start()
    if not _ready(q, dec, 600):
        return {"error": f"decode_stall: the decode process exited with {dec.exitcode} before it was ready", "rows": []}
    pre = ctx.Process(target=_stall_prefill_proc,
                      args=(spec, devices[0], shape_name, forward_ms, ctl, q, go, done, decode_gone))
    pre.start()
    out = _collect(q, ("stall", "stall_prefill"), (dec, pre), 900)
    if "stall" not in out:
        return {"error": f"decode_stall did not finish: exit codes {[p.exitcode for p in (dec, pre)]}", "rows": []}
    rows, metrics, error = out["stall"]
    base = rows[0]
    for r in rows:
        r["p99_vs_none"] = r["step_p99_ms"] / base["step_p99_ms"]
    return {"rows": rows, "model": shape_name, "forward_ms_emulated": forward_ms, "decode_transport": metrics,
            "decode_error": error, "prefill_failures": out.get("stall_prefill", [None])[0],
            "prefill_errors": out.get("stall_prefill", [None, []])[1]}


def _ready(q, proc, timeout_s: float) -> bool:
    """Waits for the child's ("decode_ready",) message; False if it exits (or the time is up) first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            msg = q.get(timeout=2.0)
        except Exception:
            if not proc.is_alive() and q.empty():
                return False
            continue
        assert msg[0] == "decode_ready", msg
        return True
    return False


def _collect(q, kinds, procs, timeout_s: float) -> dict:
    """Messages of these kinds from the children; gives up when they are all gone or at the timeout."""
    out, deadline = {}, time.monotonic() + timeout_s
    while not set(kinds) <= set(out) and time.monotonic() < deadline:
        try:
            m = q.get(timeout=2.0)
        except Exception:
            if not any(p.is_alive() for p in procs) and q.empty():
                break
            continue
        out[m[0]] = m[1:]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


# -- 3. TTFT with layer-wise overlap on and off ----------------------------------------------------------
def _ttft_prefill_proc(spec_d, device, shape_name, tokens, ctl, q):
    from cluster.model.loader import random_model
    from cluster.engine.model_runner import PrefillChunk
    from cluster.sampling.sampler import sample_tokens
    from cluster.worker.worker_config import WorkerConfig
    from prefill_worker.prefill_worker import PrefillWorker

    device = _device(device)
    arch = _arch(shape_name)
    torch.manual_seed(0)
    model = random_model(arch, _dtype(device), device)
    # No prefix cache: every rep computes its whole prompt (and the prompts differ anyway).
    cfg = WorkerConfig(model_dir="", device=device, num_blocks=2 * (tokens // 16 + 2), max_prefill_tokens=max(4096, tokens),
                       enable_prefix_caching=False)
    w = PrefillWorker("p0", cfg, model=model, arch=arch)
    t = create_transport(TransportSpec(**spec_d), w.kv_cache, "p0", "prefill")
    w.set_transport(t)
    t.connect(["d0"])
    req = _request("probe", tokens, 1)
    blocks = list(range(1, tokens // 16 + 1))

    def alone() -> float:  # the same forward and first-token sampling, nothing shipped; wall seconds
        t0 = time.monotonic()
        logits = w.runner.prefill([PrefillChunk(req.prompt_token_ids, 0, blocks)])
        sample_tokens(logits, [req.params], [req.seed], [tokens])  # syncs
        return time.monotonic() - t0
    alone()
    compute_s = sorted(alone() for _ in range(5))[2]
    w.start()
    q.put(("ttft_ready", compute_s))
    while True:
        item = ctl.get()
        if item is None:
            break
        task, layerwise = item
        t.layerwise_min_tokens = 0 if layerwise else 1 << 30
        t_submit = time.monotonic()
        result = w.submit(task).result(timeout=120)
        q.put(("ttft_sent", task.request.request_id, t_submit, result.prefill_s, result.transfer_s, result.ok, result.error))
    w.shutdown()
    t.close()


def _ttft_decode_proc(spec_d, device, shape_name, tokens, reps, ctl, q, finished):
    device = _device(device)
    arch = _arch(shape_name)
    nb = tokens // 16 + 4
    pool = torch.zeros((arch.num_layers, 2, nb, 16, arch.num_kv_heads, arch.head_dim), dtype=_dtype(device), device=device)
    t = create_transport(TransportSpec(**spec_d), pool, "d0", "decode")
    import threading

    wake = threading.Event()
    t.set_wakeup(wake.set)
    q.put(("decode_ready",))
    seq, rows = 0, []
    for layerwise in (False, True, False, True):  # alternated: drift over time hits both alike
        for rep in range(reps + 1):  # +1 warm-up
            req = _request(f"t{seq}", tokens, 1, salt=1 + seq % 500)
            res = Reservation(req.request_id, "d0", tuple(range(1, tokens // 16 + 2)), seq)
            t.expect(res, "p0")
            ctl.put((PrefillTask(req, res), layerwise))
            got = []
            while not got:  # clear, look, then nap: a wake-up while looking is not lost
                wake.clear()
                got = t.poll_arrivals()
                if not got:
                    wake.wait(1.0)
            rows.append((req.request_id, layerwise, rep, time.monotonic(), got[0].error))
            seq += 1
    ctl.put(None)
    q.put(("ttft_landed", rows))
    finished.wait(60)  # the prefill side reported every transfer: closing now cuts none of them short
    t.close()


def ttft_overlap(backend, devices, shape_name, tokens, reps) -> dict:
    store = start_store("127.0.0.1", 0)
    spec = _spec(store, "ttft", backend)
    ctx = mp.get_context("spawn")
    q, ctl, finished = ctx.Queue(), ctx.Queue(), ctx.Event()
    dec = ctx.Process(target=_ttft_decode_proc, args=(spec, devices[1], shape_name, tokens, reps, ctl, q, finished))
    pre = ctx.Process(target=_ttft_prefill_proc, args=(spec, devices[0], shape_name, tokens, ctl, q))
    dec.start()
    if not _ready(q, dec, 300):
        return {"error": f"ttft_overlap: the decode process exited with {dec.exitcode} before it was ready", "rows": []}
    pre.start()
    sent, landed, compute_s, deadline = {}, None, None, time.monotonic() + 900
    while (landed is None or any(r[0] not in sent for r in landed)) and time.monotonic() < deadline:
        try:
            m = q.get(timeout=2.0)
        except Exception:
            if not (dec.is_alive() or pre.is_alive()) and q.empty():
                break
            continue
        if m[0] == "ttft_ready":
            compute_s = m[1]
        elif m[0] == "ttft_sent":
            sent[m[1]] = m[2:]
        elif m[0] == "ttft_landed":
            landed = m[1]
    finished.set()
    for p in (dec, pre):
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if landed is None or compute_s is None:
        return {"error": f"ttft_overlap did not finish: exit codes {[p.exitcode for p in (dec, pre)]}", "rows": []}
    rows = []
    for layerwise in (False, True):
        ttfts, prefill, exposed, errors = [], [], [], []
        for rid, lw, rep, t_landed, err in landed:
            if lw != layerwise or rep == 0:
                continue
            if rid not in sent:
                errors.append(err or f"{rid}: no result from the prefill side")
                continue
            t_submit, prefill_s, transfer_s, ok, perr = sent[rid]
            if err or not ok:
                errors.append(err or perr)
                continue
            ttfts.append(t_landed - t_submit)
            prefill.append(prefill_s)
            exposed.append(transfer_s)
        med = sorted(ttfts)[len(ttfts) // 2] if ttfts else float("nan")
        worker_s = sorted(prefill)[len(prefill) // 2] if prefill else float("nan")
        rows.append({"layerwise": layerwise, "prompt_tokens": tokens, "model": shape_name, "reps": len(ttfts),
                     "ttft_s": med, "prefill_alone_s": compute_s, "transfer_share": (med - compute_s) / med,
                     "transfer_share_in_run": (med - worker_s) / med,
                     "worker_prefill_s": worker_s if prefill else None,
                     "worker_transfer_after_forward_s": sorted(exposed)[len(exposed) // 2] if exposed else None,
                     "all_ttft_s": ttfts, "errors": errors[:3]})
        log(f"ttft layerwise={layerwise}: {rows[-1]}")
    return {"rows": rows}


# -- 4. the staging kernel alone (one GPU) -----------------------------------------------------------------
def staging_kernel(shape: KVShape, sizes, slot_mib, device: str) -> dict:
    """The gather (cache -> slot) and scatter (slot -> pool) of every launch of a bundle's plan, timed
    apart; blocks scattered over both caches as a busy pool leaves them."""
    import random

    nb = 2 * max(sizes) // shape.block_size + 2
    g = torch.Generator(device=device).manual_seed(0)
    dims = (shape.layers, 2, nb, shape.block_size, shape.kv_heads, shape.head_dim)
    cache = torch.randn(dims, generator=g, device=device, dtype=torch.float32).to(shape.torch_dtype)
    pool = torch.zeros_like(cache)
    elem = cache.element_size()
    rows = []
    for mib in slot_mib:
        ps = PlanSpec("torch_dist", shape.layers, shape.block_size, shape.kv_heads, shape.head_dim, shape.dtype,
                      elem, int(mib * (1 << 20)))
        slots = [torch.empty(ps.chunk_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        for n in sizes:
            blocks = n // shape.block_size
            rng = random.Random(n)
            src = torch.tensor(rng.sample(range(1, nb), blocks), dtype=torch.int32, device=device)
            dst = torch.tensor(rng.sample(range(1, nb), blocks), dtype=torch.int32, device=device)
            launches = plan_launches(ps, blocks)
            views = [slots[k % 2][:la.nbytes(ps)].view(cache.dtype).view((la.layers, 2, la.blocks) + dims[3:])
                     for k, la in enumerate(launches)]

            def gather(las=launches, vs=views, src=src):
                for la, v in zip(las, vs):
                    copy_blocks(v, None, cache[la.l0:la.l1], src[la.b0:la.b1])

            def scatter(las=launches, vs=views, dst=dst):
                for la, v in zip(las, vs):
                    copy_blocks(pool[la.l0:la.l1], dst[la.b0:la.b1], v, None)

            def both():  # each launch gathered then scattered: the transfer without its wire
                for la, v in zip(launches, views):
                    copy_blocks(v, None, cache[la.l0:la.l1], src[la.b0:la.b1])
                    copy_blocks(pool[la.l0:la.l1], dst[la.b0:la.b1], v, None)
            nbytes = shape.bytes_for(n)
            t_gather, t_scatter = _time(gather), _time(scatter)
            t_first = _time(lambda: gather(launches[:1], views[:1]))
            t_last = _time(lambda: scatter(launches[-1:], views[-1:]))
            pool.zero_()
            both()
            exact = torch.equal(pool[:, :, dst.long()].view(torch.uint8), cache[:, :, src.long()].view(torch.uint8))
            if cache.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            gather()  # enqueued, not waited for: the host's cost of issuing the launches
            host_s = time.perf_counter() - t0
            if cache.is_cuda:
                torch.cuda.synchronize()
            rows.append({"prompt_tokens": n, "slot_MiB": mib, "launches": len(launches), "bytes": nbytes,
                         "gather_ms": t_gather * 1e3, "scatter_ms": t_scatter * 1e3,
                         "gather_GBps": nbytes / t_gather / 1e9, "scatter_GBps": nbytes / t_scatter / 1e9,
                         "first_gather_ms": t_first * 1e3, "last_scatter_ms": t_last * 1e3,
                         "host_us_per_launch": host_s / len(launches) * 1e6, "exact": exact})
            log(f"staging {n} tokens, {mib} MiB slots: {rows[-1]}")
    return {"rows": rows, "device": str(cache.device), "kv_shape": shape.describe()}


def evaluate_targets(doc: dict) -> dict:
    """The issue's targets, from what this run measured (None where a stage did not run)."""
    rows = {r["prompt_tokens"]: r for r in doc.get("rows", []) if r["path"] in ("nccl", "gloo")}
    big = {str(n): round(r["of_baseline"], 3) for n, r in sorted(rows.items()) if n >= 2048}
    out = {"of_baseline_from_2048": big or None,
           "of_baseline_ge_0.8_from_2048": all(v >= 0.8 for v in big.values()) if big else None,
           "ms_at_128": round(rows[128]["kv_ready_to_arrival_s"] * 1e3, 3) if 128 in rows else None}
    out["le_0.3ms_at_128"] = out["ms_at_128"] <= 0.3 if out["ms_at_128"] is not None else None
    stall = (doc.get("decode_stall") or {}).get("rows") or []
    ratios = {r["mode"]: round(r["p99_vs_none"], 3) for r in stall if r["mode"] != "none"}
    out["decode_p99_vs_none"] = ratios or None
    out["decode_p99_le_1.1x"] = all(v <= 1.1 for v in ratios.values()) if ratios else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="loadtest/results")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--paths", default="nccl,nccl_cold,nccl_slot16m,nccl_slot64m")
    ap.add_argument("--stages", default="transfer,stall,ttft", help="any of transfer,stall,ttft,staging (one GPU)")
    ap.add_argument("--name", default="nccl_h200x2", help="output file stem")
    ap.add_argument("--staging-slot-mib", default="16,32,64", help="slot sizes the staging stage times")
    ap.add_argument("--stall-model", default="llama-1b-shape")
    ap.add_argument("--stall-batch", type=int, default=32)
    ap.add_argument("--stall-seconds", type=float, default=8.0, help="per phase")
    ap.add_argument("--stall-interval-ms", type=float, default=50.0, help="one incoming transfer every ...")
    ap.add_argument("--stall-tokens", type=int, default=2048)
    ap.add_argument("--stall-forward-ms", type=float, default=30.0, help="emulated prefill forward (layer-wise phase)")
    ap.add_argument("--ttft-model", default="llama-8b-shape")
    ap.add_argument("--ttft-tokens", type=int, default=2048)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo, tiny shapes, short phases")
    args = ap.parse_args(argv)
    backend, devices, shape = "nccl", ("cuda:0", "cuda:1"), KV_SHAPES["llama-8b"]
    stages = set(args.stages.split(","))
    if args.dry_run:
        backend, devices, shape = "gloo", ("cpu", "cpu"), KV_SHAPES["tiny"]
        args.paths, args.stall_model, args.ttft_model = "gloo", "tiny", "tiny"
        args.stall_batch, args.stall_seconds, args.stall_interval_ms, args.stall_tokens = 4, 1.0, 150.0, 256
        args.stall_forward_ms, args.ttft_tokens, args.ttft_reps = 40.0, 256, 2
        args.staging_slot_mib = "0.0078125,1"  # 8 KiB: a tiny layer in windows; 1 MiB: one launch
        if args.sizes == ",".join(map(str, SIZES)):
            args.sizes = "32,256"
    elif torch.cuda.device_count() < (1 if stages <= {"staging"} else 2):
        sys.exit("bench_nccl needs 2 GPUs (1 for --stages staging), or --dry-run")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    sizes = [int(s) for s in args.sizes.split(",")]
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "kv_shape": shape.describe(), "command": "python benchmarks/bench_nccl.py " + " ".join(argv or sys.argv[1:]),
           "rows": [], "errors": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every stage: a later one that hangs loses nothing before it
        doc["targets"] = evaluate_targets(doc)
        (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    if "transfer" in stages:
        base = baseline(sizes, shape, backend, devices)
        for path in args.paths.split(","):
            t0 = time.monotonic()
            res = run_path(path, sizes, devices[0], devices[1], shape, quick=args.dry_run, layerwise=False)
            log(f"{path}: {time.monotonic() - t0:.0f}s, errors {res.get('error') or res.get('errors')}")
            doc["errors"][path] = res.get("error") or res.get("errors", [])[:5]
            doc.setdefault("connect_s", {})[path] = res.get("connect_s")
            for r in res["rows"]:
                nbytes, sec = base[r["prompt_tokens"]]
                r["baseline_GBps"] = nbytes / sec / 1e9
                r["baseline_seconds"] = sec
                r["of_baseline"] = r["GBps"] / r["baseline_GBps"]
            doc["rows"] += res["rows"]
        doc["baseline"] = f"torch.distributed {backend} send/recv of one contiguous buffer of the same bytes, {devices[0]} -> {devices[1]}"
        print_rows(doc["rows"])
        print(f"{'path':11} {'tokens':>6} {'ms':>8} {'of baseline':>11} exact")
        for r in doc["rows"]:
            print(f"{r['path']:11} {r['prompt_tokens']:6d} {r['kv_ready_to_arrival_s'] * 1e3:8.3f} "
                  f"{100 * r['of_baseline']:10.1f}% {r['exact']}")
        save()
    if "stall" in stages:
        doc["decode_stall"] = decode_stall(backend, devices, args.stall_model, args.stall_batch, args.stall_seconds,
                                           args.stall_interval_ms / 1e3, args.stall_tokens, args.stall_forward_ms)
        save()
    if "ttft" in stages:
        doc["ttft_overlap"] = ttft_overlap(backend, devices, args.ttft_model, args.ttft_tokens, args.ttft_reps)
        save()
    if "staging" in stages:
        doc["staging"] = staging_kernel(shape, sizes, [float(x) for x in args.staging_slot_mib.split(",")], devices[0])
        save()
    if doc["rows"]:
        plot(doc["rows"], out / f"{args.name}.png")
    log(f"targets: {json.dumps(doc['targets'])}")
    log(f"wrote {out / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
