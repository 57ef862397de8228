"""DecodeWorker: the decode side of the cluster, without Ray (decode_worker/actor.py wraps it).

The loop, on its own thread, one iteration per decode step:
    take arrived KV  ->  local prefill (token-budgeted)  ->  schedule step t+1  ->  launch step t+1
    ->  read step t's tokens (they were copied to pinned memory while t+1 was queued)  ->  publish
Publishing only enqueues: the TokenPublisher's thread detokenizes, applies stop strings (a match
ends the request here, through abort()) and sends each gateway its own requests' text.
The local prefill of an iteration is capped at `local_prefill_chunk_tokens` while requests are
decoding (FCFS chunks, cluster.chunked_prefill), so a long local prompt is spread over several
iterations, each followed by a decode step: running requests see a bounded stall per token, never
the whole prompt's prefill. With nothing decoding, the whole `max_prefill_tokens` budget is used.
Step t+1 is launched before step t's tokens are read: its rows that continue from step t take their
input token from the device, so the host never waits for the GPU to form the next batch. Nothing in
the loop waits on Ray; callers (router, gateway) reach it through thread-safe methods that take a
short lock: reserve(), submit_local(), abort(), stats(), step_metrics().

Tensor parallelism: with a TPGroup (`group`, this process is its rank 0), everything above runs here
unchanged; the model is this rank's shard, and every forward (local prefill, decode step) is announced
to the followers first (cluster/model_runner.py, bucketed_graph_runner.py; decode_worker/rank_follower.py
runs them). A failure of the loop then takes the whole worker down (`TPGroup.fail`: the ranks may have
run different passes), instead of restarting the loop: Ray restarts the worker, the router migrates.

A request is refused (400) by the one fit rule, cluster.request_limits (its context length is the
served max_model_len, its KV this worker's pool). Before serving, warmup() runs DecodeWorkerWarmup
(decode_worker/warmup.py) beside the idle loop.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from cluster.block_hash import prefix_cache_salt
from cluster.errors import InvalidRequestError
from cluster.messages import (GenerateRequest, KVCacheEvents, Reservation, ReserveRequest, TokenBatch, TokenDelta,
                              WorkerStats)
from cluster.model.config import ModelArchConfig
from cluster.model.llama import LlamaForCausalLM
from cluster.pass_rate import DevicePassTimer, PassRateMeter
from cluster.request_limits import check_request_fits, served_max_model_len
from cluster.sampler import sample_tokens
from cluster.sequence import Sequence
from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.tokenizer import load_tokenizer
from cluster.transport.base import KVReceiver
from cluster.worker_config import WorkerConfig
from cluster.worker_model import WorkerModel
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner, StepHandle
from decode_worker.metrics import StepMetrics, StepRecord
from decode_worker.scheduler import DecodeBatch, DecodeScheduler
from decode_worker.token_publisher import TokenPublisher
from decode_worker.warmup import DecodeWorkerWarmup

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002  # the loop's nap when there is nothing to do; new work wakes it at once
MAX_LOOP_RESTARTS = 3  # a loop that failed more often stays down: the worker reports itself unhealthy
_LOST_KEPT = 100_000  # request ids a failed loop dropped, remembered for the router's `lost()`


@dataclass
class _Launched:
    batch: DecodeBatch
    handle: StepHandle
    host_s: float  # host time spent on this step before launch (schedule + prepare)


class DecodeWorker:
    def __init__(self, worker_id: str, cfg: WorkerConfig, stats_sink: str | None = None, *,
                 model: LlamaForCausalLM | None = None, capture_progress: bool = True, start: bool = True,
                 group=None):
        """`stats_sink`: the router's step-record sink; token deltas go to each request's `reply_to`.
        `group`: the TPGroup this process leads (tensor parallelism), or None."""
        self.worker_id = worker_id
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        wm = WorkerModel.load(cfg, group, model=model)
        self.group = wm.group if group is not None and group.size > 1 else None
        self.model = wm.model
        self.arch: ModelArchConfig = wm.arch
        self.dtype = wm.dtype
        self.max_model_len = served_max_model_len(cfg.max_model_len, self.arch.max_position_embeddings)
        self.spec = wm.spec
        num_blocks = self.spec.num_blocks
        # The KV pool (this rank's KV heads). A transport writes arriving prompts' K/V straight into its blocks.
        self.kv_cache: torch.Tensor = wm.kv_cache
        self.prefill_runner = wm.runner
        self.graph_runner = BucketedGraphRunner.for_worker(wm, cfg, self.max_model_len, capture_progress)

        self.blocks = BlockManager(num_blocks, cfg.block_size,
                                   prefix_cache_salt(cfg.model_dir, str(self.dtype), cfg.block_size),
                                   cfg.enable_prefix_caching)
        self.scheduler = DecodeScheduler(self.blocks, cfg.max_num_seqs, cfg.max_prefill_tokens, self.max_model_len)
        self.metrics = StepMetrics()
        # Measured costs the router plans with: local prefill per token, decode step per row.
        self.prefill_meter = PassRateMeter()
        self._prefill_timer = DevicePassTimer(self.prefill_meter, self.device)
        self.step_meter = PassRateMeter()
        self.prefill_tokens_total = 0
        self.local_prefill_log: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self.chunk_tokens = max(1, min(cfg.local_prefill_chunk_tokens, cfg.max_prefill_tokens))
        self.warmup_info: dict = {}
        self._warming = False  # warm-up requests run: nothing is published
        self.publisher = TokenPublisher(worker_id, load_tokenizer(cfg.model_dir), stats_sink, on_stop=self.abort)
        self.transport: KVReceiver | None = None

        self._lock = threading.RLock()  # reentrant: the loop drains under it
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Structured output: grammars compile on their own pool; a finished compile wakes the loop.
        self.grammars = GrammarCompiler(lambda: load_tokenizer(cfg.model_dir), self.arch.vocab_size,
                                        self.arch.eos_token_ids, on_ready=self._wake.set)
        self._transfer_seq: dict[str, int] = defaultdict(int)  # per prefill peer
        self._expected: dict[str, tuple[Reservation, str]] = {}  # request id -> (reservation, prefill peer) of
        # the transfers that may still land
        self._outbox: list[TokenDelta] = []  # deltas from outside the loop (aborts), published next step
        self._step = 0
        self._last_step_info = (0.0, 0, 0, -1)  # (step time, batch size, bucket, step) of the last finished step
        self._rng = random.Random(cfg.seed)
        self.error: str | None = None
        self.loop_failures = 0
        self._lost: dict[str, str] = {}  # request id -> why: dropped by a failed loop (insertion order)
        self._fault: str | None = None  # inject_fault()
        self._thread = threading.Thread(target=self._loop, name=f"decode-loop-{worker_id}", daemon=True)
        if start:
            self._thread.start()

    # -- transport --------------------------------------------------------------------------------
    def attach_transport(self, transport: KVReceiver) -> None:
        """Binds the KV transport (built over `self.kv_cache`); reserve() then calls its expect(). The
        transport wakes the loop when an arrival may be ready, so an idle loop notices it at once."""
        with self._lock:
            self.transport = transport
        transport.set_wakeup(self._wake.set)

    # -- API for the router and gateway (any thread) ----------------------------------------------
    def _make_sequence(self, req: GenerateRequest) -> Sequence:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("empty prompt", "prompt")
        p = req.params
        check_request_fits(n, p.max_tokens, self.max_model_len, block_size=self.spec.block_size,
                           kv_blocks=self.blocks.capacity, holder=f"decode worker {self.worker_id}")
        if not all(-(2**63) <= x < 2**63 for x in (p.top_k, *p.stop_token_ids)):
            # Checked here, not in the loop: an int64 overflow there would fail every request.
            raise InvalidRequestError("top_k and stop_token_ids must fit in 64 bits", "top_k")
        p.check_token_ids(self.arch.vocab_size)  # they index the sampling kernels' tables
        seq = Sequence(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), params=req.params,
                       seed=req.seed, eos_token_ids=self.arch.eos_token_ids, detokenizer=None)
        if p.structured is not None:  # a bad schema is a 400 here, before anything is reserved
            self.grammars.check(p.structured)
            # A migrated request's prompt ends with the tokens it generated: its grammar replays them.
            prior = req.prompt_token_ids[n - req.resumed_tokens:] if req.resumed_tokens else ()
            seq.grammar = self.grammars.grammar_for(p.structured, req.request_id, prior)
        return seq

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
                self._expected[seq.request_id] = (res, peer)
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

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Drops the request (the router gave up on it, or its publisher matched a stop string; with
        `error`, it ends with that error instead)."""
        with self._lock:
            pending = self._expected.get(request_id)
            if self.scheduler.abort(request_id, transfer_pending=pending is not None):
                # ends its publisher state
                self._outbox.append(TokenDelta(request_id, (), "abort") if error is None
                                    else TokenDelta(request_id, (), "error", error))
            if pending is not None:
                # Unclaimed, it is cancelled now and its blocks come back with the (failed) arrival;
                # claimed, it lands first.
                self.transport.cancel(*pending)
        self._wake.set()

    def peer_died(self, peer: str, why: str) -> None:
        """A prefill peer is dead (the router heard it from Ray): the transfers expected from it fail
        now and their reserved blocks come back, without waiting for the transport's heartbeat timeout."""
        t = self.transport
        if t is not None and hasattr(t, "peer_died"):
            t.peer_died(peer, why)

    def lost(self, request_id: str) -> bool:
        """Whether a failure of this worker (not of the request: a loop exception) dropped the request:
        the router then moves it like a dead worker's (prompt + tokens so far, same seed)."""
        with self._lock:
            return request_id in self._lost

    def inject_fault(self, kind: str) -> None:
        """Fault injection (chaos tests): "loop": the decode loop raises at its next iteration."""
        if kind != "loop":
            raise ValueError(f"unknown fault {kind!r}")
        self._fault = kind
        self._wake.set()

    def stats(self) -> WorkerStats:
        self._prefill_timer.harvest()
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
                       "steps": self._step, "error": self.error, "warmup": self.warmup_info,
                       "loop_failures": self.loop_failures,
                       **({"tensor_parallel": self.group.describe()} if self.group is not None else {}),
                       **self.blocks.allocator.stats_extra()},
                prefill_rate=self.prefill_meter.rate(), decode_rate=self.step_meter.rate(),
                local_prefill_chunk_tokens=self.chunk_tokens, prefill_tokens_total=self.prefill_tokens_total,
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

    def warmup(self, timeout_s: float = 600.0) -> dict:
        """Before the worker serves (the launcher calls it before /ready): every prefill shape class
        and synthetic requests through the serving path (decode_worker/warmup.py); nothing is
        published. Seeds the measured rates; returns what ran."""
        self.warmup_info = DecodeWorkerWarmup(self, timeout_s).run()
        return self.warmup_info

    def poll_token_batches(self, timeout: float = 0.0) -> list:
        """The StreamBatches of requests without a reply_to so far (tests and in-process use)."""
        return self.publisher.drain(timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.publisher.close()
        self.grammars.close()
        if self.transport is not None:
            self.transport.close()
        if self.group is not None:
            self.group.close()

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Runs the loop; an exception in it fails the requests it held as *lost* (the router moves
        them, like a dead worker's), settles the device and the block accounting, and starts the loop
        again, up to MAX_LOOP_RESTARTS times; after that (or a CUDA error, which poisons the context)
        the worker reports itself unhealthy."""
        while True:
            try:
                self._run_loop()
                return
            except Exception as e:  # noqa: BLE001 - report, fail every request, stay alive for stats()
                log.exception("decode loop of %s failed", self.worker_id)
                self.loop_failures += 1
                why = f"decode worker {self.worker_id} failed: {type(e).__name__}: {e}"
                if self.group is not None:
                    # The followers may have run passes this rank did not (or the reverse): the group
                    # cannot go on. Its requests are lost here; the whole worker goes down (by default
                    # its process ends, and Ray restarts it as a new group).
                    self._fail_all(why, lost=True)
                    self.error = why
                    self.group.fail(why)
                    return
                recoverable = self._settle_after_failure(why) and self.loop_failures <= MAX_LOOP_RESTARTS
                if not recoverable or self._stop.is_set():
                    self.error = why
                    return
                log.warning("decode loop of %s restarted (failure %d of at most %d)", self.worker_id,
                            self.loop_failures, MAX_LOOP_RESTARTS)

    def _settle_after_failure(self, why: str) -> bool:
        """After a loop exception: every request here fails as lost; once the device is idle, the
        steps launched so far count as done (their deferred frees land). False if the device is not
        usable any more."""
        self._fail_all(why, lost=True)
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - a sticky CUDA error: this process cannot compute any more
            log.exception("decode worker %s: the device is not usable after the failure", self.worker_id)
            return False
        with self._lock:
            self.scheduler.steps_abandoned(self._step - 1)
            self._outbox.clear()
        return True

    def _run_loop(self) -> None:
        inflight: _Launched | None = None
        while not self._stop.is_set():
            if self._fault == "loop":
                self._fault = None
                raise RuntimeError("injected fault")
            t0 = time.perf_counter()
            # Cleared before the work is looked at, so a wake-up that comes while we look (an
            # arrival landing right after its commit) is not lost to the nap below.
            self._wake.clear()
            with self._lock:
                deltas = self._outbox
                self._outbox = []
                deltas += self._take_arrivals()
                self._fail_grammars()
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
            if deltas and not self._warming:
                step_s, bs, bucket, step = self._last_step_info
                self._last_step_info = (0.0, 0, 0, -1)  # a step's record goes out once
                self.publisher.publish(TokenBatch(self.worker_id, step if bs else self._step, tuple(deltas),
                                                  step_s, bs, bucket))
            if inflight is None and not deltas:
                self._wake.wait(_IDLE_WAIT_S)

    def _finish(self, launched: _Launched) -> list[TokenDelta]:
        """Reads a launched step's tokens (waits for that step only) and applies them."""
        tokens = launched.handle.tokens()
        t0 = time.perf_counter()
        logprobs = launched.handle.logprobs()
        with self._lock:
            deltas = self.scheduler.on_step_output(launched.batch, tokens, logprobs)
        info = launched.handle.info
        self._last_step_info = (launched.handle.gpu_time_s, info.batch_size, info.bucket if info.graph else 0,
                                launched.batch.step)
        self.step_meter.add(info.batch_size, launched.handle.gpu_time_s)
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
            self._expected.pop(rid, None)
            ok = a.error is None and a.header is not None and a.header.ok
            first = a.header.first_token if ok else None
            d = self.scheduler.on_arrival(rid, first, ok, a.error, a.header.logprobs if ok else None)
            if d is not None:
                deltas.append(d)
        return deltas

    def _fail_grammars(self) -> None:
        """Requests whose grammar failed after admission (cluster.structured) end with its error."""
        for rid, error in self.grammars.take_failed():
            self.abort(rid, error)

    @torch.inference_mode()
    def _local_prefill(self) -> list[TokenDelta]:
        self.scheduler.readmit_preempted()
        # Capped while requests decode: the step that follows this chunk is theirs (see the docstring).
        chunks = self.scheduler.schedule_prefill(self.chunk_tokens if self.scheduler.running else None)
        if not chunks:
            return []
        tokens = sum(len(c.token_ids) for _, c in chunks)
        start = self._prefill_timer.start()
        # Prompt logprobs on a request's first prefill (a preempted one's recompute has sent them).
        wants = [(s.prompt_token_ids, s.params.prompt_logprobs)
                 if s.params.prompt_logprobs is not None and not s.output_token_ids else None for s, _ in chunks]
        logits, prompt_lps = self.prefill_runner.prefill_with_prompt_logprobs([c for _, c in chunks], wants)
        for (seq, _), lps in zip(chunks, prompt_lps):
            if lps is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or []) + lps
        self._prefill_timer.stop(start, tokens)
        self.prefill_tokens_total += tokens
        # (decode steps launched so far, tokens, requests decoding): what the chunk cap did.
        self.local_prefill_log.append((self._step, tokens, len(self.scheduler.running)))
        done = self.scheduler.on_prefill_done(chunks)
        deltas = []
        for s in [s for s in done if s.params.scores_prompt_only]:  # prompt scoring: no token
            deltas.append(self.scheduler.on_prompt_scored(s, tuple(s.prompt_logprobs or ())))
            done.remove(s)
        if not done:
            return deltas
        rows = [i for i, (s, _) in enumerate(chunks) if s in done]
        # NOTE: syncs; the local prefill is eager anyway.
        tokens, logprobs = sample_tokens(logits[rows], [s.params for s in done], [s.seed for s in done],
                                         [s.num_tokens for s in done], [s.prompt_token_ids for s in done],
                                         [s.output_token_ids for s in done], [s.grammar for s in done])
        for s, t, lp in zip(done, tokens, logprobs):
            prompt_lps, s.prompt_logprobs = s.prompt_logprobs, None  # sent with the first token, once
            deltas.append(self.scheduler.on_prefill_token(s, t, lp, tuple(prompt_lps) if prompt_lps is not None
                                                          else None))
        return deltas

    def _fail_all(self, error: str, lost: bool = False) -> None:
        with self._lock:
            s = self.scheduler
            ids = list(s.waiting_for_kv) + [x.request_id for x in s.waiting] + [x.request_id for x in s.running]
            for rid in ids:
                s.abort(rid, transfer_pending=rid in self._expected)
                pending = self._expected.get(rid)
                if pending is not None and self.transport is not None:
                    self.transport.cancel(*pending)  # unclaimed: its blocks come back with the failed arrival
                if lost:
                    self._lost[rid] = error
            while len(self._lost) > _LOST_KEPT:
                del self._lost[next(iter(self._lost))]
            deltas = [TokenDelta(rid, (), "error", error) for rid in ids]
        if deltas:
            self.publisher.publish(TokenBatch(self.worker_id, self._step, tuple(deltas)))

