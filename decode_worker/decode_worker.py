"""DecodeWorker: the decode side of the cluster, without Ray (decode_worker/actor.py wraps it).

The loop, on its own thread, one iteration per decode step:
    take arrived KV  ->  queue a local-prefill pass (paced)  ->  schedule step t+1  ->  launch step t+1
    ->  read the pass's first tokens  ->  read step t's tokens (copied to pinned memory while t+1 was
    queued)  ->  publish
Publishing only enqueues: the TokenPublisher, in a process of its own (decode_worker/publisher_process.py),
detokenizes, applies stop strings (a match ends the request here, through abort()) and sends each
gateway its own requests' text; nothing of it competes with the loop for the interpreter.
The local prefill of an iteration is paced while requests are decoding (LocalPrefillPacer: a pass
takes what costs about one decode step by the measured rates, at most `local_prefill_chunk_tokens`,
and waits a few steps for more prompts to share its fixed cost; FCFS chunks, cluster.chunked_prefill),
so a long local prompt is spread over several iterations, each followed by a decode step: running
requests see a bounded stall per token, never the whole prompt's prefill. With nothing decoding, the
whole `max_prefill_tokens` budget is used. A pass's first-token draws are read only after the next
decode step is launched (they wait for the pass, not for that step), so the device never idles for it.
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
from typing import Callable

import torch

from cluster.block_hash import prefix_cache_salt
from cluster.errors import InvalidRequestError
from cluster.messages import (GenerateRequest, KVCacheEvents, Reservation, ReserveRequest, TokenBatch, TokenDelta,
                              WorkerStats)
from cluster.model.config import ModelArchConfig
from cluster.model.llama import LlamaForCausalLM
from cluster.pass_rate import DevicePassTimer, PassRateMeter
from cluster.request_limits import check_request_fits, served_max_model_len
from cluster.sampler import SampledTokens, sample_tokens_async
from cluster.sequence import Sequence, SequenceStatus
from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.tokenizer import load_tokenizer
from cluster.transport.base import KVReceiver
from cluster.transport.plan import KVNumerics
from cluster.worker_config import WorkerConfig
from cluster.worker_model import WorkerModel
from decode_worker.block_manager import BlockManager
from decode_worker.local_prefill_pacer import LocalPrefillPacer
from decode_worker.bucketed_graph_runner import BucketedGraphRunner, StepHandle
from decode_worker.metrics import StepMetrics, StepRecord
from decode_worker.scheduler import DecodeBatch, DecodeScheduler
from decode_worker.step_interval import LaunchSpan, StepIntervalClock
from decode_worker.publisher_process import PublisherProcess
from decode_worker.token_publisher import TokenPublisher
from decode_worker.warmup import DecodeWorkerWarmup

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002  # the loop's nap when there is nothing to do; new work wakes it at once
_LOST_KEPT = 100_000  # request ids a failed loop dropped, remembered for the router's `lost()`


def _make_publisher(worker_id: str, cfg: WorkerConfig, stats_sink: str | None, on_stop, where: str):
    """The worker's token publisher: in a process of its own ("process", the served path: it never
    competes with the decode loop for the interpreter), or on a thread of this one ("thread")."""
    if where not in ("process", "thread"):
        raise ValueError(f"token_publisher must be 'process' or 'thread', got {where!r}")
    if where == "process":
        return PublisherProcess(worker_id, cfg.model_dir, stats_sink, on_stop=on_stop, secret=cfg.cluster_secret)
    return TokenPublisher(worker_id, load_tokenizer(cfg.model_dir), stats_sink, on_stop=on_stop,
                          secret=cfg.cluster_secret)


@dataclass
class _PendingPrefill:
    done: list[Sequence]  # the sequences whose prompt the pass completed
    drawn: SampledTokens  # their first tokens, queued on the device


@dataclass
class TokenCountFault:
    """Fault injection keyed on what a client has received (tests, chaos): fires once, when the first
    matching request reaches exactly `after_tokens` tokens, counting the tokens it resumed from after a
    migration (so a request moved at that point never fires it again). The batch carrying that token
    is published (with none of the request's later tokens), then the fault happens before anything
    else is: the client has exactly `after_tokens` tokens.

    kind "loop": the decode loop raises (its requests are lost, the loop restarts);
    kind "restart": the worker's state dies at once as in a crash (nothing more is published, no
    request is failed by the worker itself) and `DecodeWorker.on_restart` brings up a new incarnation."""

    kind: str
    after_tokens: int
    seed: int | None = None  # only the request sampled with this seed (None: any request)


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
        `token_publisher`: "process" (the served path) or "thread" (see _make_publisher).
        `group`: the TPGroup this process leads (tensor parallelism), or None. The token publisher, the
        scheduler and the loop are this rank's alone; the followers only run the passes it announces."""
        self.worker_id = worker_id
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        # Started first: its process loads the tokenizer while this one loads the model.
        self.publisher = _make_publisher(worker_id, cfg, stats_sink, self.abort, token_publisher)
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
        # Measured costs the router plans with: local prefill per token, decode step per row.
        self.prefill_meter = PassRateMeter()
        self._prefill_timer = DevicePassTimer(self.prefill_meter, self.device)
        self.step_meter = PassRateMeter()
        self.prefill_tokens_total = 0
        self.local_prefill_log: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self.chunk_tokens = max(1, min(cfg.local_prefill_chunk_tokens, cfg.max_prefill_tokens))
        self.pacer = LocalPrefillPacer(self.chunk_tokens)
        self._last_step_s: float | None = None  # the latest decode step's device time (the pacer's budget)
        self.warmup_info: dict = {}
        self._warming = False  # warm-up requests run: nothing is published
        self.publisher.wait_ready()
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
        # (step time, batch size, bucket, step, StepTiming) of the last finished step
        self._last_step_info = (0.0, 0, 0, -1, None)
        self._interval_clock = StepIntervalClock(self.device.type == "cuda")
        self._rng = random.Random(cfg.seed)
        self.error: str | None = None
        self.loop_failures = 0
        self._lost: dict[str, str] = {}  # request id -> why: dropped by a failed loop (insertion order)
        self._fault: str | None = None  # inject_fault(): "loop" raises at the loop's next iteration
        self._count_fault: TokenCountFault | None = None  # inject_fault(kind, after_tokens=K)
        self.faults_fired: list[dict] = []  # what the injected faults did (stats()["extra"])
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
                       seed=req.seed, eos_token_ids=self.arch.eos_token_ids, detokenizer=None,
                       resumed_tokens=req.resumed_tokens)
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
        if kind not in ("loop", "restart"):
            raise ValueError(f"unknown fault {kind!r}")
        if after_tokens is None:
            if kind != "loop":
                raise ValueError(f"fault {kind!r} needs after_tokens")
            self._fault = kind
        else:
            if after_tokens < 1:
                raise ValueError("after_tokens must be >= 1")
            if kind == "restart" and self.on_restart is None:
                raise ValueError("this worker cannot restart in place (no on_restart)")
            with self._lock:
                self._count_fault = TokenCountFault(kind, after_tokens, seed)
        self._wake.set()

    def clear_faults(self) -> None:
        """Disarms what inject_fault armed and has not fired."""
        with self._lock:
            self._fault, self._count_fault = None, None

    def stats(self) -> WorkerStats:
        self._prefill_timer.harvest()
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
                       "loop_failures": self.loop_failures, "faults_fired": list(self.faults_fired),
                       # KV control frames dropped for a bad or missing MAC (cluster/frame_auth.py)
                       "kv_frames_rejected": getattr(self.transport, "frames_rejected", 0),
                       **({"tensor_parallel": self.group.describe()} if self.group is not None else {}),
                       **self.blocks.allocator.stats_extra()},
                prefill_rate=self.prefill_meter.rate(), decode_rate=self.step_meter.rate(),
                # The local-prefill pass size while decoding: the pacer's latest budget (<= the cap).
                local_prefill_chunk_tokens=self.pacer.last_budget, prefill_tokens_total=self.prefill_tokens_total,
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
        m.update(graph_buckets=list(gr.buckets), feature_graph_buckets=list(gr.feature_buckets),
                 graphs_captured=gr.num_captures, capture_seconds=gr.capture_seconds, capture_bytes=gr.capture_bytes,
                 capture=gr.capture_summary())
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
                scored, prefill = self._start_local_prefill()  # the pass and its first-token draws, queued
                deltas += scored
                batch = self.scheduler.schedule_decode(self._step, pipeline_busy=inflight is not None)
                if batch.needs_drain:  # pool short: let every deferred free land, then preempt
                    deltas += self._finish(inflight)
                    inflight = None
                    batch = self.scheduler.schedule_decode(self._step, pipeline_busy=False)
                launched = None
                if batch.rows:
                    handle = self.graph_runner.launch(batch.rows)
                    self.scheduler.on_step_launched(batch)
                    launched = _Launched(batch, handle, time.perf_counter() - t0,
                                         self._interval_clock.launched(handle.ran_in_launch_s))
                    self._step += 1
            if prefill is not None:
                # Read after step t+1 was launched: the draw waits for the pass only, the step queued
                # behind it keeps the device busy; the new sequences join at step t+2.
                deltas += self._finish_local_prefill(prefill)
            if inflight is not None:
                deltas += self._finish(inflight)  # step t+1 is queued behind it: the GPU stays busy
            inflight = launched
            fired = None
            if self._count_fault is not None and deltas:
                deltas, fired = self._cut_at_fault(deltas)
            if deltas and not self._warming:
                step_s, bs, bucket, step, timing = self._last_step_info
                self._last_step_info = (0.0, 0, 0, -1, None)  # a step's record goes out once
                self.publisher.publish(TokenBatch(self.worker_id, step if bs else self._step, tuple(deltas),
                                                  step_s, bs, bucket, timing, time.perf_counter()))
            if fired is not None:
                if fired.kind == "restart":
                    self._die()
                    return
                self._fault = "loop"  # raises at the top of the next iteration: nothing else goes out
            if inflight is None and not deltas:
                t_nap = time.perf_counter()
                self._wake.wait(_IDLE_WAIT_S)
                self._interval_clock.idle(time.perf_counter() - t_nap)

    def _cut_at_fault(self, deltas: list[TokenDelta]) -> tuple[list[TokenDelta], TokenCountFault | None]:
        """The armed TokenCountFault against this iteration's deltas (loop thread, before they are
        published): when a matching request reaches exactly `after_tokens` tokens here, its later
        tokens in the batch are cut and the fault is returned (disarmed)."""
        f = self._count_fault
        with self._lock:
            s = self.scheduler
            seqs = {x.request_id: x for x in (*s.running, *s.waiting, *s.waiting_for_kv.values())}
        in_batch: dict[str, int] = {}
        for d in deltas:
            if d.token_ids:
                in_batch[d.request_id] = in_batch.get(d.request_id, 0) + len(d.token_ids)
        target = None
        for rid, n in in_batch.items():
            seq = seqs.get(rid)  # (one that finished in this batch is not here: its end is not a fault point)
            if seq is None or (f.seed is not None and seq.seed != f.seed):
                continue
            before = seq.resumed_tokens + len(seq.output_token_ids) - n  # tokens it had sent before this batch
            if before < f.after_tokens <= before + n:
                target, keep = rid, f.after_tokens - before
                break
        if target is None:
            return deltas, None
        out = []
        for d in deltas:
            if d.request_id == target and d.token_ids:
                if keep <= 0:
                    continue
                if len(d.token_ids) > keep:
                    d = TokenDelta(d.request_id, d.token_ids[:keep], None, None,
                                   None if d.logprobs is None else d.logprobs[:keep], d.prompt_logprobs)
                keep -= len(d.token_ids)
            out.append(d)
        with self._lock:
            self._count_fault = None
        self.faults_fired.append({"kind": f.kind, "after_tokens": f.after_tokens, "seed": f.seed,
                                  "request_id": target, "step": self._step})
        return out, f

    def _die(self) -> None:
        """Fault "restart" (loop thread): the worker's state dies here as in a crash. The publisher
        sends what it was given so far and nothing after; the loop stops without failing any request
        (the router finds them lost, as a dead worker's); `on_restart` brings up the new incarnation."""
        self.publisher.halt()
        # NOTE: the last frames are out of our sockets; the loop thread (whose life is what stats()
        # calls healthy) lives a moment more so that they reach their gateways before the router can
        # find the worker dead: the client has exactly `after_tokens` tokens. (In a real crash frames
        # sent just before it may or may not arrive; the migration resumes from what the client got.)
        time.sleep(0.2)
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
                if not ok:
                    # A transfer that failed (a broken pair, a dead or stuck prefill) is the cluster's
                    # failure, not the request's: the router moves it when its gateway asks (lost()).
                    self._mark_lost(rid, a.error or "its KV transfer failed")
                deltas.append(d)
        return deltas

    def _mark_lost(self, request_id: str, why: str) -> None:
        self._lost[request_id] = why
        while len(self._lost) > _LOST_KEPT:
            del self._lost[next(iter(self._lost))]

    def _fail_grammars(self) -> None:
        """Requests whose grammar failed after admission (cluster.structured) end with its error."""
        for rid, error in self.grammars.take_failed():
            self.abort(rid, error)

    @torch.inference_mode()
    def _start_local_prefill(self) -> tuple[list[TokenDelta], _PendingPrefill | None]:
        """Under the lock: queues a local-prefill pass (paced while requests decode: LocalPrefillPacer)
        and the first-token draws of the prompts it completes; nothing waits for the device. Returns
        the deltas of prompts it only scored (no token to draw) and the queued draws."""
        s = self.scheduler
        s.readmit_preempted()
        budget = None  # nothing decoding: the whole max_prefill_tokens, at once
        if s.running:
            budget = self.pacer.budget(self.prefill_meter.rate(), self._last_step_s)
            if not self.pacer.ready(s.prefill_waiting_tokens(), budget, self._step):
                return [], None
        chunks = s.schedule_prefill(budget)
        if not chunks:
            return [], None
        tokens = sum(len(c.token_ids) for _, c in chunks)
        span = self._interval_clock.prefill_start()  # the pass and its first-token draw, between two steps
        start = self._prefill_timer.start()
        # Prompt logprobs on a request's first prefill (a preempted one's recompute has sent them).
        wants = [(q.prompt_token_ids, q.params.prompt_logprobs)
                 if q.params.prompt_logprobs is not None and not q.output_token_ids else None for q, _ in chunks]
        logits, prompt_lps = self.prefill_runner.prefill_with_prompt_logprobs([c for _, c in chunks], wants)
        for (seq, _), lps in zip(chunks, prompt_lps):
            if lps is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or []) + lps
        self._prefill_timer.stop(start, tokens)
        self.prefill_tokens_total += tokens
        # (decode steps launched so far, tokens, requests decoding): what the chunk cap did.
        self.local_prefill_log.append((self._step, tokens, len(s.running)))
        done = s.on_prefill_done(chunks)
        scored = []
        for q in [q for q in done if q.params.scores_prompt_only]:  # prompt scoring: no token
            scored.append(s.on_prompt_scored(q, tuple(q.prompt_logprobs or ())))
            done.remove(q)
        drawn = None
        if done:
            rows = [i for i, (q, _) in enumerate(chunks) if q in done]
            # The grammar masks are filled now; each grammar advances with its token in _finish_local_prefill.
            drawn = sample_tokens_async(logits[rows], [q.params for q in done], [q.seed for q in done],
                                        [q.num_tokens for q in done], [q.prompt_token_ids for q in done],
                                        [q.generated_token_ids for q in done], [q.grammar for q in done])
        self._interval_clock.prefill_end(span)
        return scored, (_PendingPrefill(done, drawn) if done else None)

    def _finish_local_prefill(self, pending: _PendingPrefill) -> list[TokenDelta]:
        """The first tokens of the prompts a pass completed (waits for their draw only), then, under
        the lock, those sequences start decoding. One aborted meanwhile is left out."""
        tokens, logprobs = pending.drawn.result()
        deltas = []
        with self._lock:
            for s, t, lp in zip(pending.done, tokens, logprobs):
                if s.status is not SequenceStatus.WAITING:
                    continue  # aborted between the pass and now (its blocks are back already)
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

