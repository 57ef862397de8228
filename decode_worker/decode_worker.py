"""DecodeWorker: the decode side of the cluster, without Ray (decode_worker/actor.py wraps it).

The loop (`_run_loop`, its own thread), one iteration per decode step: take arrivals (KV landed, the
outbox) -> queue a paced local-prefill pass -> schedule step t+1 -> launch it -> read the pass's first
tokens and step t's tokens (copied to pinned memory while t+1 was queued) -> publish. Step t+1's rows
that continue from step t take their input token from the device, so the host never waits for the GPU
to form the next batch, and nothing in the loop waits on Ray. A local prefill (decode_worker/
local_prefill.py) is paced while requests decode: running requests see a bounded stall per token.
Publishing only enqueues: the TokenPublisher, in a process of its own (publisher_process.py),
detokenizes, applies stop strings (a match ends the request here, through abort()) and sends each
gateway its own requests' text. Callers (router, gateway) reach the worker through thread-safe
methods that take a short lock: reserve(), submit_local(), abort(), stats(), step_metrics().

Tensor parallelism: with a TPGroup (`group`, this process is its rank 0) everything above runs here
unchanged on this rank's shard, every forward announced to the followers first (rank_follower.py). A
failure of the loop then takes the whole worker down (`TPGroup.fail`) instead of restarting the loop.

A request is refused (400) by the one fit rule, cluster.kv.request_limits. warmup() runs warmup.py beside
the idle loop. Fault injection (tests, chaos) has one seam in the loop: a FaultPlan, None in production.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from cluster.kv.block_hash import prefix_cache_salt
from cluster.errors import InvalidRequestError
from cluster.wire.messages import (GenerateRequest, KVCacheEvents, Reservation, ReserveRequest, TokenBatch, TokenDelta,
                              WorkerStats)
from cluster.model.config import ModelArchConfig
from cluster.model.llama import LlamaForCausalLM
from cluster.worker.pass_rate import PassRateMeter
from cluster.kv.request_limits import served_max_model_len
from cluster.engine.sequence import Sequence
from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.text.tokenizer import load_tokenizer
from cluster.transport.base import KVReceiver
from cluster.transport.plan import KVNumerics
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.worker_model import WorkerModel
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.expected_transfers import ExpectedTransfers
from decode_worker.local_prefill import LocalPrefill
from decode_worker.metrics import StepMetrics, StepRecord
from decode_worker.scheduler import DecodeBatch, DecodeScheduler
from decode_worker.sequence_builder import SequenceBuilder
from decode_worker.step_handle import StepHandle
from decode_worker.step_interval import LaunchSpan, StepIntervalClock
from decode_worker.publisher_process import make_publisher
from cluster.faults.fault_plan import FaultPlan, TokenCountFault
from decode_worker.warmup import DecodeWorkerWarmup, WarmupParts

log = logging.getLogger(__name__)

# The loop's nap with nothing to do; new work wakes it at once (`_wake`: a submit, a landed or failed
# transfer, a compiled grammar, stop). Holding requests it naps _IDLE_WAIT_S (what it checks by time is a
# held request's); holding none (read unlocked: a request that came meanwhile set `_wake`), _EMPTY_WAIT_S.
_IDLE_WAIT_S, _EMPTY_WAIT_S = 0.002, 0.05
_LOST_KEPT = 100_000  # request ids a failed loop dropped, remembered for the router's `lost()`


@dataclass
class _Launched:
    batch: DecodeBatch
    handle: StepHandle
    host_s: float  # host time spent on this step before launch (schedule + prepare)
    span: LaunchSpan  # what the loop did since the previous launch (the step's interval)


class DecodeWorker:
    def __init__(self, worker_id: str, cfg: WorkerConfig, stats_sink: str | None = None, *,
                 model: LlamaForCausalLM | None = None, capture_progress: bool = True, start: bool = True,
                 token_publisher: str = "process", group=None):
        """`stats_sink`: the router's step-record sink; token deltas go to each request's `reply_to`.
        `token_publisher`: "process" (the served path) or "thread" (see publisher_process.make_publisher).
        `group`: the TPGroup this process leads (tensor parallelism), or None. The token publisher, the
        scheduler and the loop are this rank's alone; the followers only run the passes it announces."""
        self.worker_id = worker_id
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        # Started first: its process loads the tokenizer while this one loads the model.
        self.publisher = make_publisher(worker_id, cfg, stats_sink, self.abort, token_publisher)
        try:
            self._setup(model, capture_progress, start, group)
        except BaseException:
            self.publisher.close()  # its process must not outlive a worker that never started
            raise

    def _setup(self, model: LlamaForCausalLM | None, capture_progress: bool, start: bool, group) -> None:
        cfg = self.cfg
        wm = WorkerModel.load(cfg, group, model=model)
        self.group = wm.group if group is not None and group.size > 1 else None
        self.model = wm.model
        self.arch: ModelArchConfig = wm.arch
        # The activation dtype: the configured one, else the embedding's (WorkerModel).
        self.dtype = wm.dtype
        self.max_model_len = served_max_model_len(cfg.max_model_len, self.arch.max_position_embeddings)
        self.spec = wm.spec
        num_blocks = self.spec.num_blocks
        # What the K/V it holds depends on (PrefillWorker.kv_numerics: the same rule, so both salt alike).
        self.kv_numerics = wm.kv_numerics
        # The KV pool (this rank's KV heads). A transport writes arriving prompts' K/V straight into its blocks.
        self.kv_cache: torch.Tensor = wm.kv_cache
        self.prefill_runner = wm.runner
        self.graph_runner = BucketedGraphRunner.for_worker(wm, cfg, self.max_model_len, capture_progress)

        self.blocks = BlockManager(num_blocks, cfg.block_size,
                                   prefix_cache_salt(cfg.model_dir, self.kv_numerics, cfg.block_size),
                                   cfg.enable_prefix_caching)
        self.scheduler = DecodeScheduler(self.blocks, cfg.max_num_seqs, cfg.max_prefill_tokens, self.max_model_len)
        self.metrics = StepMetrics()
        # Measured cost the router plans with: decode step per row (local prefill's: self.local_prefill.meter).
        self.step_meter = PassRateMeter()
        self._last_step_s: float | None = None  # the latest decode step's device time (the pacer's budget)
        self.warmup_info: dict = {}
        self._warming = False  # warm-up requests run: nothing is published
        self.publisher.wait_ready()
        self.transfers = ExpectedTransfers(self.worker_id, self.spec.block_size)  # with the transport, once attached

        self._lock = threading.RLock()  # reentrant: the loop drains under it
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Structured output: grammars compile on their own pool; a finished compile wakes the loop.
        self.grammars = GrammarCompiler(lambda: load_tokenizer(cfg.model_dir), self.arch.vocab_size,
                                        self.arch.eos_token_ids, on_ready=self._wake.set)
        self.sequences = SequenceBuilder(self.worker_id, self.arch, self.max_model_len, self.spec.block_size,
                                         self.blocks, self.grammars)
        self._outbox: list[TokenDelta] = []  # deltas from outside the loop (aborts), published next step
        self._step = 0
        # (step time, batch size, bucket, step, StepTiming) of the last finished step
        self._last_step_info = (0.0, 0, 0, -1, None)
        self._interval_clock = StepIntervalClock(self.device.type == "cuda")
        self.local_prefill = LocalPrefill(self.scheduler, self.prefill_runner, self._interval_clock, self.device,
                                          max(1, min(cfg.local_prefill_chunk_tokens, cfg.max_prefill_tokens)),
                                          self._lock)
        self.error: str | None = None
        self.loop_failures = 0
        self._lost: dict[str, str] = {}  # request id -> why: dropped by a failed loop (insertion order)
        self.faults: FaultPlan | None = None  # tests and chaos (inject_fault); None in production
        # Fault "restart": called on the loop's thread once the worker's state is dead (the actor brings
        # up a new incarnation); None: that fault is refused.
        self.on_restart: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._loop, name=f"decode-loop-{self.worker_id}", daemon=True)
        if start:
            self._thread.start()

    # -- transport --------------------------------------------------------------------------------
    def kv_numerics_info(self) -> KVNumerics:
        """What this cache's K/V is, for the KV transport's pair check (cluster/transport/plan.py)."""
        return KVNumerics(str(self.spec.dtype).removeprefix("torch."), self.kv_numerics)

    def attach_transport(self, transport: KVReceiver) -> None:
        """Binds the KV transport (built over `self.kv_cache`); reserve() then calls its expect(). The
        transport wakes the loop when an arrival may be ready, so an idle loop notices it at once."""
        with self._lock:
            self.transfers.transport = transport
        transport.set_wakeup(self._wake.set)

    @property
    def transport(self) -> KVReceiver | None:
        return self.transfers.transport

    # -- API for the router and gateway (any thread) ----------------------------------------------
    def _admit(self, seq: Sequence, req: GenerateRequest, add: Callable[[Sequence], bool]) -> bool:
        """Under the lock: whether `add` (a scheduler's entry) took the request's (built) Sequence."""
        if self.scheduler.holds(seq.request_id):
            raise InvalidRequestError(f"request {seq.request_id!r} is already on this worker", "request_id")
        self.publisher.register(req)
        if not add(seq):
            self.publisher.forget(seq.request_id)
            return False
        return True

    def reserve(self, req: ReserveRequest) -> Reservation | None:
        """Reserves blocks for the prompt + 1 token; None if they don't fit now."""
        seq = self.sequences.build(req.request)
        with self._lock:
            if not self._admit(seq, req.request, self.scheduler.reserve):
                return None
            return self.transfers.reserve(seq, req.prefill_worker_id)

    def submit_local(self, req: GenerateRequest) -> int | None:
        """Prefills here (between decode steps), then decodes. Returns the prompt tokens found in this
        worker's prefix cache (not computed), or None if the request does not fit now."""
        seq = self.sequences.build(req)
        with self._lock:
            if not self._admit(seq, req, self.scheduler.add_local):
                return None
            cached = seq.num_cached_tokens  # before the loop starts computing it
        self._wake.set()
        return cached

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Drops the request (the router gave up on it, or its publisher matched a stop string; with
        `error`, it ends with that error instead)."""
        with self._lock:
            pending = self.transfers.pending(request_id)
            if self.scheduler.abort(request_id, transfer_pending=pending):
                # ends its publisher state
                self._outbox.append(TokenDelta(request_id, (), "abort") if error is None
                                    else TokenDelta(request_id, (), "error", error))
            if pending:
                # Unclaimed, it is cancelled now and its blocks come back with the (failed) arrival;
                # claimed, it lands first.
                self.transfers.cancel(request_id)
        self._wake.set()

    def peer_died(self, peer: str, why: str) -> None:
        """A prefill peer is dead (the router heard it from Ray): the transfers expected from it fail
        now and their reserved blocks come back, without waiting for the transport's heartbeat timeout."""
        t = self.transport
        if t is not None and hasattr(t, "peer_died"):
            t.peer_died(peer, why)

    def lost(self, request_id: str) -> bool:
        """Whether a failure of this worker or of its KV transfer (not of the request: a loop exception,
        a broken pair) dropped the request: the router then moves it like a dead worker's (prompt +
        tokens so far, same seed)."""
        with self._lock:
            return request_id in self._lost

    def inject_fault(self, kind: str, after_tokens: int | None = None, seed: int | None = None) -> None:
        """Fault injection (chaos and reliability tests). "loop": the decode loop raises at its next
        iteration, or with `after_tokens` right after a request (the one with `seed`, else any) has
        sent exactly that many tokens (TokenCountFault); "restart" (with `after_tokens`): the worker's
        state dies there as in a crash and `on_restart` makes a new incarnation."""
        plan = self.faults or FaultPlan()
        plan.arm(kind, after_tokens, seed, can_restart=self.on_restart is not None)
        self.faults = plan
        self._wake.set()

    def clear_faults(self) -> None:
        """Disarms what inject_fault armed and has not fired."""
        if self.faults is not None:
            self.faults.disarm()

    def stats(self) -> WorkerStats:
        lp = self.local_prefill
        lp.timer.harvest()
        with self._lock:
            s = self.scheduler
            return WorkerStats(
                worker_id=self.worker_id, role="decode",
                healthy=self.error is None and self._thread.is_alive() and self.publisher.alive,
                free_blocks=self.blocks.num_free, total_blocks=self.blocks.capacity, running=len(s.running),
                waiting=len(s.waiting_for_kv) + len(s.waiting),
                outstanding_prefill_tokens=sum(x.num_tokens - x.num_cached_tokens for x in s.waiting),
                graph_buckets=tuple(self.graph_runner.buckets), max_num_seqs=self.cfg.max_num_seqs,
                extra={"waiting_for_kv": len(s.waiting_for_kv), "local_prefill": len(s.waiting),
                       "pending_free_blocks": self.blocks.num_pending_free, "preemptions": s.num_preemptions,
                       "steps": self._step, "error": self.error, "warmup": self.warmup_info,
                       "loop_failures": self.loop_failures, "faults_fired": list(self.faults.fired if self.faults else ()),
                       # KV control frames dropped for a bad or missing MAC (cluster/wire/frame_auth.py)
                       "kv_frames_rejected": getattr(self.transport, "frames_rejected", 0),
                       **({"tensor_parallel": self.group.describe()} if self.group is not None else {}),
                       **self.blocks.allocator.stats_extra()},
                prefill_rate=lp.meter.rate(), decode_rate=self.step_meter.rate(),
                # The local-prefill pass size while decoding: the pacer's latest budget (<= the cap).
                local_prefill_chunk_tokens=lp.pacer.last_budget, prefill_tokens_total=lp.tokens_total,
            )

    def kv_events(self, epoch: str | None, seq: int) -> KVCacheEvents:
        """How this worker's cached blocks changed since (epoch, seq) (router.placement.kv_index)."""
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
        m.update(graph_buckets=list(gr.buckets), feature_graph_buckets=list(gr.feature_buckets),
                 graphs_captured=gr.num_captures, capture_seconds=gr.capture_seconds, capture_bytes=gr.capture_bytes,
                 capture=gr.capture_summary())
        return m

    def warmup(self, timeout_s: float = 600.0) -> dict:
        """Before the worker serves (the launcher calls it before /ready): every prefill shape class
        and synthetic requests through the serving path (decode_worker/warmup.py); nothing is
        published. Seeds the measured rates; returns what ran."""
        parts = WarmupParts(self.worker_id, self.cfg, self.device, self.arch.vocab_size, self.max_model_len, self._lock,
                            self.scheduler, self.blocks, self.local_prefill, self.prefill_runner, self.grammars,
                            self.publisher.forget, self.submit_local, self._wake.set, self.quiet, self._reset_step_metrics)
        self.warmup_info = DecodeWorkerWarmup(parts, timeout_s).run()
        return self.warmup_info

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Pauses the loop's publishing: inside, the loop runs its steps but sends no token and no step
        record (the warm-up's requests); on the way out what it held back is dropped."""
        with self._lock:
            self._warming = True
        try:
            yield
        finally:
            with self._lock:
                self._outbox.clear()
                self._last_step_info = (0.0, 0, 0, -1, None)  # no held-back step record goes out
                self._warming = False

    def _reset_step_metrics(self) -> None:  # the warm-up's steps are not served steps
        self.metrics = StepMetrics()

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
        again, up to `cfg.max_loop_restarts` times; after that (or a CUDA error, which poisons the
        context) the worker reports itself unhealthy. A tensor-parallel worker's loop is never
        restarted: its failure fails the whole group (TPGroup.fail)."""
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
                    # cannot go on, whatever cfg.max_loop_restarts says. Its requests are lost here;
                    # the whole worker goes down (by default its process ends, and Ray restarts it as
                    # a new group).
                    self._fail_all(why, lost=True)
                    self.error = why
                    self.group.fail(why)
                    return
                recoverable = (self._settle_after_failure(why)
                               and self.loop_failures <= self.cfg.max_loop_restarts)
                if not recoverable or self._stop.is_set():
                    self.error = why
                    return
                log.warning("decode loop of %s restarted (failure %d of at most %d)", self.worker_id,
                            self.loop_failures, self.cfg.max_loop_restarts)

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
        inflight: _Launched | None = None  # step t: launched, its tokens not read yet
        while not self._stop.is_set():
            t0 = time.perf_counter()
            # Cleared before the work is looked at, so a wake-up that comes while we look (an
            # arrival landing right after its commit) is not lost to the nap below.
            self._wake.clear()
            with self._lock:
                deltas = self._take_outbox() + self.transfers.landed(self.scheduler, self._mark_lost)
                self._fail_grammars()
                scored, prefill = self.local_prefill.start(self._step, self._last_step_s)  # queued, paced
                deltas += scored
                batch = self.scheduler.schedule_decode(self._step, pipeline_busy=inflight is not None)
                if batch.needs_drain:  # pool short: let every deferred free land, then preempt
                    deltas += self._finish(inflight)
                    inflight = None
                    batch = self.scheduler.schedule_decode(self._step, pipeline_busy=False)
                launched = self._launch(batch, t0) if batch.rows else None  # step t+1
            if prefill is not None:
                # Read after step t+1 was launched: the draw waits for the pass only, the step queued
                # behind it keeps the device busy; the new sequences join at step t+2.
                deltas += self.local_prefill.finish(prefill)
            if inflight is not None:
                deltas += self._finish(inflight)  # step t; t+1 is queued behind it: the GPU stays busy
            inflight = launched
            fault = None
            if self.faults is not None:  # the one fault seam (tests, chaos): may cut this batch
                deltas, fault = self.faults.cut(deltas, self._sequences, self._step)
            self._publish(deltas)
            if fault is not None:
                return self._fire(fault)
            if inflight is None and not deltas:
                t_nap = time.perf_counter()
                self._wake.wait(_IDLE_WAIT_S if self.scheduler.num_seqs else _EMPTY_WAIT_S)
                self._interval_clock.idle(time.perf_counter() - t_nap)

    def _take_outbox(self) -> list[TokenDelta]:  # (under the lock)
        deltas, self._outbox = self._outbox, []
        return deltas

    def _launch(self, batch: DecodeBatch, t0: float) -> _Launched:
        handle = self.graph_runner.launch(batch.rows)
        self.scheduler.on_step_launched(batch)
        self._step += 1
        return _Launched(batch, handle, time.perf_counter() - t0, self._interval_clock.launched(handle.ran_in_launch_s))

    def _publish(self, deltas: list[TokenDelta]) -> None:
        if deltas and not self._warming:
            step_s, bs, bucket, step, timing = self._last_step_info
            self._last_step_info = (0.0, 0, 0, -1, None)  # a step's record goes out once
            self.publisher.publish(TokenBatch(self.worker_id, step if bs else self._step, tuple(deltas),
                                              step_s, bs, bucket, timing, time.perf_counter()))

    def _sequences(self) -> dict[str, Sequence]:
        with self._lock:
            return self.scheduler.sequences()

    def _fire(self, fault: TokenCountFault) -> None:
        """An injected fault, right after the batch that reached it was published: "restart" stops the
        worker as in a crash, "loop" raises (the loop's failure path: its requests are lost)."""
        if fault.kind != "restart":
            raise RuntimeError("injected fault")
        self._die()

    def _die(self) -> None:
        """Fault "restart" (loop thread): the worker's state dies here as in a crash. The publisher
        sends what it was given so far and nothing after; the loop stops without failing any request
        (the router finds them lost, as a dead worker's); `on_restart` brings up the new incarnation."""
        # NOTE: the last frames reach their gateways before the router can find the worker dead (the
        # client has exactly `after_tokens` tokens): stats() calls it healthy while its publisher is
        # alive, which halt() ends only once every frame published so far left (TokenPublisher._run's
        # end). (In a real crash they may not arrive; the migration resumes from what the client got.)
        self.publisher.halt()
        self.error = "restarting (injected fault)"
        self._stop.set()
        self.on_restart()

    def _finish(self, launched: _Launched) -> list[TokenDelta]:
        """Reads a launched step's tokens (waits for that step only) and applies them."""
        h = launched.handle
        tokens = h.tokens()
        t0 = time.perf_counter()
        self._interval_clock.waited(h.wait_s)
        logprobs = h.logprobs()
        with self._lock:
            deltas = self.scheduler.on_step_output(launched.batch, tokens, logprobs)
        info = h.info
        timing = self._interval_clock.timing(launched.span, h.gpu_time_s, h.interval_s)
        self._last_step_s = h.gpu_time_s
        self._last_step_info = (h.gpu_time_s, info.batch_size, info.bucket if info.graph else 0, launched.batch.step,
                                timing)
        self.step_meter.add(info.batch_size, h.gpu_time_s)
        self.metrics.record(StepRecord(step=launched.batch.step, batch_size=info.batch_size, bucket=info.bucket,
                                       padded_rows=info.bucket - info.batch_size, graph=info.graph, step_time_s=h.gpu_time_s,
                                       host_time_s=launched.host_s + time.perf_counter() - t0))
        return deltas

    def _mark_lost(self, request_id: str, why: str) -> None:
        self._lost[request_id] = why
        while len(self._lost) > _LOST_KEPT:
            del self._lost[next(iter(self._lost))]

    def _fail_grammars(self) -> None:
        """Requests whose grammar failed after admission (cluster.structured) end with its error."""
        for rid, error in self.grammars.take_failed():
            self.abort(rid, error)

    def _fail_all(self, error: str, lost: bool = False) -> None:
        with self._lock:
            s = self.scheduler
            ids = list(s.waiting_for_kv) + [x.request_id for x in s.waiting] + [x.request_id for x in s.running]
            for rid in ids:
                s.abort(rid, transfer_pending=self.transfers.pending(rid))
                self.transfers.cancel(rid)  # unclaimed: its blocks come back with the failed arrival
                if lost:
                    self._mark_lost(rid, error)
            deltas = [TokenDelta(rid, (), "error", error) for rid in ids]
        if deltas:
            self.publisher.publish(TokenBatch(self.worker_id, self._step, tuple(deltas)))

