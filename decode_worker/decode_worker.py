"""DecodeWorker: the decode side of the cluster, without Ray (decode_worker/actor.py wraps it).

The loop, on its own thread, one iteration per decode step:
    take arrived KV  ->  local prefill (token-budgeted)  ->  schedule step t+1  ->  launch step t+1
    ->  read step t's tokens (they were copied to pinned memory while t+1 was queued)  ->  publish
Publishing only enqueues: the TokenPublisher's thread detokenizes, applies stop strings (a match
ends the request here, through abort()) and sends each gateway its own requests' text.
Step t+1 is launched before step t's tokens are read: its rows that continue from step t take their
input token from the device, so the host never waits for the GPU to form the next batch. Nothing in
the loop waits on Ray; callers (router, gateway) reach it through thread-safe methods that take a
short lock: reserve(), submit_local(), abort(), stats(), step_metrics().
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from cluster.block_hash import prefix_cache_salt
from cluster.errors import InvalidRequestError
from cluster.kv_cache import KVCacheSpec, kv_pool_blocks
from cluster.messages import (GenerateRequest, KVCacheEvents, Reservation, ReserveRequest, TokenBatch, TokenDelta,
                              WorkerStats)
from cluster.model.config import ModelArchConfig
from cluster.model.llama import LlamaForCausalLM
from cluster.model.loader import load_model, resolve_dtype
from cluster.model_runner import ModelRunner
from cluster.sampler import sample_tokens
from cluster.sequence import Sequence
from cluster.tokenizer import load_tokenizer
from cluster.transport.base import KVTransport
from cluster.worker_config import WorkerConfig
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner, StepHandle
from decode_worker.metrics import StepMetrics, StepRecord
from decode_worker.scheduler import DecodeBatch, DecodeScheduler
from decode_worker.token_publisher import TokenPublisher

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002  # the loop's nap when there is nothing to do; new work wakes it at once


@dataclass
class _Launched:
    batch: DecodeBatch
    handle: StepHandle
    host_s: float  # host time spent on this step before launch (schedule + prepare)


class DecodeWorker:
    def __init__(self, worker_id: str, cfg: WorkerConfig, stats_sink: str | None = None, *,
                 model: LlamaForCausalLM | None = None, capture_progress: bool = True, start: bool = True):
        """`stats_sink`: the router's step-record sink; token deltas go to each request's `reply_to`."""
        self.worker_id = worker_id
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if model is None:
            model = load_model(cfg.model_dir, dtype=cfg.dtype, device=self.device, attention_backend=cfg.attention_backend)
        self.model = model
        self.arch: ModelArchConfig = model.cfg
        self.dtype = next(model.parameters()).dtype if cfg.dtype is None else resolve_dtype(cfg.dtype)
        self.max_model_len = min(cfg.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings)

        num_blocks = kv_pool_blocks(cfg, self.arch, self.dtype, self.device)
        self.spec = KVCacheSpec.for_model(self.arch, cfg.block_size, num_blocks, self.dtype)
        # The KV pool. A transport writes arriving prompts' K/V straight into this tensor's blocks.
        self.kv_cache: torch.Tensor = self.spec.allocate(self.device)
        self.prefill_runner = ModelRunner(model, self.spec, self.device, kv_cache=self.kv_cache)
        self.graph_runner = BucketedGraphRunner(
            model, self.kv_cache, cfg.block_size, cfg.max_num_seqs,
            max_blocks_per_seq=self.spec.blocks_for_tokens(self.max_model_len),
            buckets=cfg.graph_buckets, use_cuda_graph=cfg.use_cuda_graph,
        )
        self.graph_runner.capture(progress=capture_progress)

        self.blocks = BlockManager(num_blocks, cfg.block_size,
                                   prefix_cache_salt(cfg.model_dir, str(self.dtype), cfg.block_size),
                                   cfg.enable_prefix_caching)
        self.scheduler = DecodeScheduler(self.blocks, cfg.max_num_seqs, cfg.max_prefill_tokens, self.max_model_len)
        self.metrics = StepMetrics()
        self.publisher = TokenPublisher(worker_id, load_tokenizer(cfg.model_dir), stats_sink, on_stop=self.abort)
        self.transport: KVTransport | None = None

        self._lock = threading.RLock()  # reentrant: the loop drains under it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._transfer_seq: dict[str, int] = defaultdict(int)  # per prefill peer
        self._expected: set[str] = set()  # request ids a transfer may still land for
        self._outbox: list[TokenDelta] = []  # deltas from outside the loop (aborts), published next step
        self._step = 0
        self._last_step_info = (0.0, 0, 0, -1)  # (step time, batch size, bucket, step) of the last finished step
        self._rng = random.Random(cfg.seed)
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"decode-loop-{worker_id}", daemon=True)
        if start:
            self._thread.start()

    # -- transport --------------------------------------------------------------------------------
    def attach_transport(self, transport: KVTransport) -> None:
        """Binds the KV transport (built over `self.kv_cache`); reserve() then calls its expect()."""
        with self._lock:
            self.transport = transport

    # -- API for the router and gateway (any thread) ----------------------------------------------
    def _make_sequence(self, req: GenerateRequest) -> Sequence:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("empty prompt", "prompt")
        if n + req.params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) exceeds "
                                      f"the decode worker's max_model_len of {self.max_model_len}", "max_tokens")
        p = req.params
        if not all(-(2**63) <= x < 2**63 for x in (p.top_k, *p.stop_token_ids)):
            # Checked here, not in the loop: an int64 overflow there would fail every request.
            raise InvalidRequestError("top_k and stop_token_ids must fit in 64 bits", "top_k")
        if self.spec.blocks_for_tokens(n + req.params.max_tokens) > self.blocks.capacity:
            raise InvalidRequestError("request does not fit in the decode worker's KV cache even alone", "max_tokens")
        return Sequence(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), params=req.params,
                        seed=req.seed, eos_token_ids=self.arch.eos_token_ids, detokenizer=None)

    def _known(self, request_id: str) -> bool:
        s = self.scheduler
        return (request_id in s.waiting_for_kv or any(x.request_id == request_id for x in s.running)
                or any(x.request_id == request_id for x in s.waiting))

    def reserve(self, req: ReserveRequest) -> Reservation | None:
        """Reserves blocks for the prompt + 1 token; None if they don't fit now."""
        seq = self._make_sequence(req.request)
        with self._lock:
            if self._known(seq.request_id):
                raise InvalidRequestError(f"request {seq.request_id!r} is already on this worker", "request_id")
            self.publisher.register(req.request)
            if not self.scheduler.reserve(seq):
                self.publisher.forget(seq.request_id)
                return None
            peer = req.prefill_worker_id
            cached = seq.num_cached_tokens // self.spec.block_size  # the transfer lands after these
            res = Reservation(seq.request_id, self.worker_id, tuple(seq.block_table[cached:]), self._transfer_seq[peer],
                              num_cached_blocks=cached)
            self._transfer_seq[peer] += 1
            if self.transport is not None:
                # Under the lock so that expect() calls reach the transport in transfer_seq order.
                self.transport.expect(res, peer)
                self._expected.add(seq.request_id)
        return res

    def submit_local(self, req: GenerateRequest) -> int | None:
        """Prefills here (between decode steps), then decodes. Returns the prompt tokens found in this
        worker's prefix cache (not computed), or None if the request does not fit now."""
        seq = self._make_sequence(req)
        with self._lock:
            if self._known(seq.request_id):
                raise InvalidRequestError(f"request {seq.request_id!r} is already on this worker", "request_id")
            self.publisher.register(req)
            if not self.scheduler.add_local(seq):
                self.publisher.forget(seq.request_id)
                return None
            cached = seq.num_cached_tokens  # before the loop starts computing it
        self._wake.set()
        return cached

    def abort(self, request_id: str) -> None:
        """Drops the request (the router gave up on it, or its publisher matched a stop string)."""
        with self._lock:
            pending = request_id in self._expected
            if self.scheduler.abort(request_id, transfer_pending=pending):
                self._outbox.append(TokenDelta(request_id, (), "abort"))  # ends its publisher state
        self._wake.set()

    def stats(self) -> WorkerStats:
        with self._lock:
            s = self.scheduler
            return WorkerStats(
                worker_id=self.worker_id, role="decode", healthy=self.error is None and self._thread.is_alive(),
                free_blocks=self.blocks.num_free, total_blocks=self.blocks.capacity, running=len(s.running),
                waiting=len(s.waiting_for_kv) + len(s.waiting),
                outstanding_prefill_tokens=sum(x.num_tokens - x.num_cached_tokens for x in s.waiting),
                graph_buckets=tuple(self.graph_runner.buckets), max_num_seqs=self.cfg.max_num_seqs,
                extra={"waiting_for_kv": len(s.waiting_for_kv), "local_prefill": len(s.waiting),
                       "pending_free_blocks": self.blocks.num_pending_free, "preemptions": s.num_preemptions,
                       "steps": self._step, "error": self.error, **self.blocks.allocator.stats_extra()},
            )

    def kv_events(self, epoch: str | None, seq: int) -> KVCacheEvents:
        """How this worker's cached blocks changed since (epoch, seq) (router.kv_index)."""
        with self._lock:
            pool = self.blocks.allocator
            return KVCacheEvents(self.worker_id, pool.hasher.salt, pool.block_size, pool.events_since(epoch, seq))

    def check_blocks(self) -> None:
        """Block accounting (tests): raises AssertionError on a leaked or doubly owned KV block."""
        with self._lock:
            self.scheduler.check_blocks()

    def step_metrics(self) -> dict:
        m = self.metrics.snapshot()
        gr = self.graph_runner
        m.update(graph_buckets=list(gr.buckets), graphs_captured=gr.num_captures,
                 capture_seconds=gr.capture_seconds, capture_bytes=gr.capture_bytes,
                 capture_stats={str(k): v for k, v in gr.capture_stats.items()})
        return m

    def poll_token_batches(self, timeout: float = 0.0) -> list:
        """The StreamBatches of requests without a reply_to so far (tests and in-process use)."""
        return self.publisher.drain(timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.publisher.close()
        if self.transport is not None:
            self.transport.close()

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        inflight: _Launched | None = None
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                with self._lock:
                    deltas = self._outbox
                    self._outbox = []
                    deltas += self._take_arrivals()
                    deltas += self._local_prefill()
                    batch = self.scheduler.schedule_decode(self._step, pipeline_busy=inflight is not None)
                    if batch.needs_drain:  # pool short: let every deferred free land, then preempt
                        deltas += self._finish(inflight)
                        inflight = None
                        batch = self.scheduler.schedule_decode(self._step, pipeline_busy=False)
                    launched = None
                    if batch.rows:
                        handle = self.graph_runner.launch(batch.rows)
                        self.scheduler.on_step_launched(batch)
                        launched = _Launched(batch, handle, time.perf_counter() - t0)
                        self._step += 1
                if inflight is not None:
                    deltas += self._finish(inflight)  # step t+1 is queued behind it: the GPU stays busy
                inflight = launched
                if deltas:
                    step_s, bs, bucket, step = self._last_step_info
                    self._last_step_info = (0.0, 0, 0, -1)  # a step's record goes out once
                    self.publisher.publish(TokenBatch(self.worker_id, step if bs else self._step, tuple(deltas),
                                                      step_s, bs, bucket))
                if inflight is None and not deltas:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except Exception as e:  # noqa: BLE001 - report, fail every request, stay alive for stats()
            log.exception("decode loop of %s failed", self.worker_id)
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(self.error)

    def _finish(self, launched: _Launched) -> list[TokenDelta]:
        """Reads a launched step's tokens (waits for that step only) and applies them."""
        tokens = launched.handle.tokens()
        t0 = time.perf_counter()
        with self._lock:
            deltas = self.scheduler.on_step_output(launched.batch, tokens)
        info = launched.handle.info
        self._last_step_info = (launched.handle.gpu_time_s, info.batch_size, info.bucket if info.graph else 0,
                                launched.batch.step)
        self.metrics.record(StepRecord(
            step=launched.batch.step, batch_size=info.batch_size, bucket=info.bucket,
            padded_rows=info.bucket - info.batch_size, graph=info.graph,
            step_time_s=launched.handle.gpu_time_s, host_time_s=launched.host_s + time.perf_counter() - t0))
        return deltas

    def _take_arrivals(self) -> list[TokenDelta]:
        if self.transport is None:
            return []
        deltas = []
        for a in self.transport.poll_arrivals():
            rid = a.reservation.request_id
            self._expected.discard(rid)
            ok = a.error is None and a.header is not None and a.header.ok
            first = a.header.first_token if ok else None
            d = self.scheduler.on_arrival(rid, first, ok, a.error)
            if d is not None:
                deltas.append(d)
        return deltas

    @torch.inference_mode()
    def _local_prefill(self) -> list[TokenDelta]:
        self.scheduler.readmit_preempted()
        chunks = self.scheduler.schedule_prefill()
        if not chunks:
            return []
        logits = self.prefill_runner.prefill([c for _, c in chunks])
        done = self.scheduler.on_prefill_done(chunks)
        if not done:
            return []
        rows = [i for i, (s, _) in enumerate(chunks) if s in done]
        # NOTE: syncs; the local prefill is eager anyway.
        tokens = sample_tokens(logits[rows], [s.params for s in done], [s.seed for s in done],
                               [s.num_tokens for s in done])
        return [self.scheduler.on_prefill_token(s, t) for s, t in zip(done, tokens)]

    def _fail_all(self, error: str) -> None:
        with self._lock:
            s = self.scheduler
            ids = list(s.waiting_for_kv) + [x.request_id for x in s.waiting] + [x.request_id for x in s.running]
            for rid in ids:
                s.abort(rid, transfer_pending=rid in self._expected)
            deltas = [TokenDelta(rid, (), "error", error) for rid in ids]
        if deltas:
            self.publisher.publish(TokenBatch(self.worker_id, self._step, tuple(deltas)))

