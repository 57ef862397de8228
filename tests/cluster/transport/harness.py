"""Test harness: a decode side built from ModelRunner.decode + the sampler (the real decode worker is
elsewhere), and a prefill worker child process driven over multiprocessing queues (test plumbing only)."""

from __future__ import annotations

import itertools
import os
import queue
import time
from collections import defaultdict

import torch

from cluster.kv.block_pool import PrefixCachingBlockPool
from cluster.kv.kv_cache import KVCacheSpec
from cluster.wire.messages import GenerateRequest, PrefillTask, Reservation
from cluster.model.config import ModelArchConfig
from cluster.model.loader import load_model, resolve_dtype
from cluster.engine.model_runner import ModelRunner
from cluster.sampling.sampler import SamplingTensors, sample
from cluster.sampling.sampling_params import SamplingParams
from cluster.transport.base import KVSend, kv_cache_blocks
from cluster.transport.factory import create_transport

_ids = itertools.count()


def request(prompt, max_tokens=8, temperature=0.0, seed=0, rid=None) -> GenerateRequest:
    return GenerateRequest(rid or f"r{next(_ids)}", tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature,
                           ignore_eos=True), seed, time.time())


def block_checksum(kv_cache: torch.Tensor, block_ids) -> list[int]:
    """Exact per-block fingerprint: the sum of the blocks' raw 32-bit words (as int64)."""
    if not block_ids:
        return []
    b = kv_cache_blocks(kv_cache, list(block_ids)).contiguous()
    words = b.view(torch.int32).to(torch.int64)
    return words.transpose(0, 2).reshape(len(block_ids), -1).sum(-1).tolist()


class DecodeSide:
    def __init__(self, worker_id, model_dir, spec, num_blocks=256, with_model=True):
        self.worker_id = worker_id
        self.arch = ModelArchConfig.from_dir(model_dir)
        dtype = resolve_dtype(self.arch.dtype)
        self.kvspec = KVCacheSpec.for_model(self.arch, 16, num_blocks, dtype)
        self.kv_cache = self.kvspec.allocate("cpu")
        self.runner = None
        if with_model:
            self.runner = ModelRunner(load_model(model_dir, device="cpu"), self.kvspec, "cpu", kv_cache=self.kv_cache)
        self.allocator = PrefixCachingBlockPool(num_blocks, 16)
        self.transport = create_transport(spec, self.kv_cache, worker_id, "decode")
        self._seq = defaultdict(itertools.count)

    def reserve(self, req: GenerateRequest, prefill_id: str, blocks=None) -> PrefillTask:
        blocks = blocks or self.allocator.allocate(self.kvspec.blocks_for_tokens(len(req.prompt_token_ids) + 1))
        res = Reservation(req.request_id, self.worker_id, tuple(blocks), next(self._seq[prefill_id]))
        self.transport.expect(res, prefill_id)
        return PrefillTask(req, res)

    # Generous by default: the prefill may be a child process at the other test stream's nice 10 (prefills,
    # a gloo pair forming), which a busy machine may leave a tenth of a core; tests of a timeout pass theirs.
    def wait_arrivals(self, n, timeout=120.0):
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            got = self.transport.poll_arrivals()
            out += got
            if not got:
                time.sleep(0.002)
        return out

    def greedy_decode(self, req: GenerateRequest, blocks, first_token: int) -> list[int]:
        """Decodes from the arrived KV exactly as the engine would after its prefill step."""
        prompt, table, out = list(req.prompt_token_ids), list(blocks), [first_token]
        while len(out) < req.params.max_tokens:
            pos = len(prompt) + len(out) - 1
            while len(table) * 16 <= pos:
                table += self.allocator.allocate(1)
            logits = self.runner.decode([out[-1]], [pos], [table])
            st = SamplingTensors.from_params([req.params], [req.seed], "cpu")
            out.append(sample(logits, st, torch.tensor([pos + 1]), False).tolist()[0])
        extra = table[len(blocks):]
        if extra:
            self.allocator.free(extra)
        return out


def prefill_child(spec, worker_id, model_dir, in_q, out_q, opts):
    """Runs a PrefillWorker with a transport; tasks come on in_q as (task, abort_after_s | None)."""
    torch.set_num_threads(1)
    from cluster.worker.worker_config import WorkerConfig
    from prefill_worker.prefill_worker import PrefillWorker

    cfg = WorkerConfig(model_dir=str(model_dir), num_blocks=opts.get("num_blocks", 256),
                       max_prefill_tokens=opts.get("budget", 64))
    w = PrefillWorker(worker_id, cfg)
    t = create_transport(spec, w.kv_cache, worker_id, "prefill")
    if opts.get("fault"):
        t.inject_fault(opts["fault"])  # "transfer" | "stuck_transfer": the first bundle carries it
    begin, die_after, slow = t.begin, opts.get("die_after_sends"), opts.get("slow", {})
    die_at = opts.get("die_at")  # "layer": killed mid-payload; "commit": payload sent, first token never
    sends = itertools.count(1)

    def snooping_begin(todo, layerwise=None):
        for s in todo:
            if die_after is not None and next(sends) > die_after:
                os._exit(17)  # killed mid-stream: the claim never comes
        sh = begin(todo, layerwise)
        commit, layer_done = sh.commit, sh.layer_done

        def dying_layer_done(i):
            if die_at == "layer" and i == 1:
                time.sleep(0.3)  # layer 0's launches are out (gloo sends from the pair's thread)
                os._exit(17)
            layer_done(i)
        sh.layer_done = dying_layer_done

        def snooping_commit(first_tokens, logprobs=None):
            # What the prefill computed, captured once the forward wrote it (test only).
            for s in todo:
                src = list(s.src_block_ids)
                kv = kv_cache_blocks(w.kv_cache, src).contiguous().view(torch.uint8).numpy().tobytes() if opts.get("ship_kv") else None
                out_q.put(("kv", s.reservation.request_id, block_checksum(w.kv_cache, src), kv))
            if die_at == "commit":
                time.sleep(0.5)  # the payload is out (gloo sends from its own threads)
                os._exit(17)
            commit(first_tokens, logprobs)
        sh.commit = snooping_commit
        return sh

    t.begin = snooping_begin
    w.set_transport(t, send_timeout_s=opts.get("send_timeout_s", 10.0))
    w.start()
    out_q.put(("ready", worker_id))
    futs, later = [], []  # later: (when, task) held back by `slow` (claimed after the decode's deadline?)
    while True:
        try:
            item = in_q.get(timeout=0.01)
        except queue.Empty:
            item = ()
        if item is None:
            break
        if item:
            task, abort_after = item
            if task.request.request_id in slow:
                later.append((time.monotonic() + slow[task.request.request_id], task))
            else:
                futs.append(w.submit(task))
                if abort_after is not None:
                    time.sleep(abort_after)
                    w.abort(task.request.request_id)
        for when, task in [x for x in later if x[0] <= time.monotonic()]:
            later.remove((when, task))
            futs.append(w.submit(task))
        for f in [f for f in futs if f.done()]:
            futs.remove(f)
            out_q.put(("result", f.result()))
    for when, task in later:
        time.sleep(max(0.0, when - time.monotonic()))
        futs.append(w.submit(task))
    for f in futs:
        out_q.put(("result", f.result(timeout=60)))
    out_q.put(("metrics", {k: v for k, v in t.metrics().items() if k != "recent"}))
    w.shutdown()
    t.close()
    out_q.put(("done", worker_id))


# -- GPU peer-death children (test_gpu_transfer.py) --------------------------------------------------
def gpu_decode_child(spec, worker_id, device, expects, cmd_q, out_q):
    """A decode transport on `device` expecting `expects` [(prefill id, Reservation)]; reports every
    arrival (with the reserved blocks' checksums) and dies when told ("die")."""
    import threading

    torch.cuda.set_device(device)
    pool = torch.zeros((4, 2, 64, 16, 8, 64), dtype=torch.bfloat16, device=device)
    t = create_transport(spec, pool, worker_id, "decode")
    wake = threading.Event()
    t.set_wakeup(wake.set)
    for peer, res in expects:
        t.expect(res, peer)
    out_q.put(("ready", worker_id))
    while True:
        try:
            if cmd_q.get_nowait() == "die":
                os._exit(19)
        except queue.Empty:
            pass
        wake.wait(0.05)
        wake.clear()
        for a in t.poll_arrivals():
            n = len(a.reservation.block_ids) - 1
            sums = block_checksum(pool, list(a.reservation.block_ids[:n])) if a.error is None else None
            out_q.put(("arrival", worker_id, a.reservation.request_id, a.error, sums, time.monotonic()))


def gpu_prefill_child(spec, device, script, cmd_q, out_q):
    """A prefill transport on `device` ("p0") running `script`: [(decode id, Reservation, "full"|"stall"
    |"die")]. "stall": layer 0 goes out, then it waits for "go" before the rest (its peer may die
    meanwhile); "die": layer 0 goes out, then this process exits."""
    torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(3)
    cache = torch.randn((4, 2, 64, 16, 8, 64), generator=g, device=device).to(torch.bfloat16)
    t = create_transport(spec, cache, "p0", "prefill")
    t.connect(sorted({d for d, _, _ in script}))
    out_q.put(("ready", "p0"))
    for peer, res, how in script:
        n = len(res.block_ids) - 1
        src = tuple(range(10, 10 + n))
        sh = t.begin([KVSend(res, n * 16, src)], layerwise=True)
        sh.layer_done(0)
        torch.cuda.synchronize()
        if how == "die":
            out_q.put(("layer0", res.request_id))
            time.sleep(1.0)  # layer 0 landed, the rest never comes
            os._exit(17)
        if how == "stall":
            out_q.put(("layer0", res.request_id))
            assert cmd_q.get(timeout=60) == "go"
        t0 = time.monotonic()
        for i in range(1, 4):
            sh.layer_done(i)
        sh.kv_done()
        sh.commit({res.request_id: 11})
        try:
            st = sh.futures[res.request_id].result(timeout=60)
            out_q.put(("sent", res.request_id, None, block_checksum(cache, list(src)), time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out_q.put(("sent", res.request_id, f"{type(e).__name__}: {e}", None, time.monotonic() - t0))
    out_q.put(("done", "p0"))
    time.sleep(2.0)
    t.close()
