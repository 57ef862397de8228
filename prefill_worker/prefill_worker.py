"""PrefillWorker: batches waiting prompts into packed variable-length prefills, samples each prompt's
first token and ships its KV to the decode worker that reserved blocks for it. No Ray here (actor.py).

One loop thread computes and ships. Before a forward that completes prompts, their transfers are
claimed (`KVSender.begin`); PassLauncher (pass_launcher.py) runs the forward, shipping each layer as it
is done, queues the first tokens' draw behind it and launches the rest of the KV, without a host sync.
The loop then reads the draw (its one wait), sends each first token to its gateway (FirstTokenSender:
the client has it before the KV lands) and `commit`s it to the decode worker, which continues from it.
With overlap on, a short pass launches first, while the one ahead is still on the device
(launched_pass.py). Nothing waits for a transfer: a prompt's blocks go back to this worker's pool
when its transfer future resolves (the payload left them, or failed).

Dispatched before its reservation (the router reserves on the decode worker meanwhile: PlacementWalk),
a prompt is computed all the same and its first token sent; its KV waits in its blocks (`parked`)
until `attach` brings the reservation, then ships in one go (under tensor parallelism, whose followers
ship during the pass, a prompt waits for its reservation before its last pass instead). Its attach
or abort may come before its submit (Ray runs an async actor's calls in no fixed order): calls_ahead.py.

Prefix caching: a prompt starts after its leading blocks found in this worker's cache (they stay
pinned, ref-counted, until its transfer is over); its blocks are registered as their chunks complete
and stay cached after the send, until evicted. Only the blocks the decode worker lacks are sent: the
reservation says how many leading blocks it already holds (`Reservation.num_cached_blocks`).

A prompt that cannot fit (cluster.kv.request_limits: the served context length, this worker's pool)
fails at submit(), and its decode worker is told at once.

Structured output: a request's grammar is checked at submit (a bad one fails the request at once)
and compiled on the GrammarCompiler's pool; the request is scheduled once it is ready (the others go
ahead), and its first token is sampled under the grammar's mask.

Tensor parallelism: with a TPGroup (`group`, this process its rank 0) the model and cache are this
rank's shard and every forward is announced to the followers first (cluster/engine/model_runner.py;
prefill_worker/rank_follower.py runs them), with what the pass ships so that each rank sends its own
heads' KV. A forward that fails then takes the whole worker down (`TPGroup.fail`) instead of failing
one batch: the ranks' collectives may no longer pair up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from cluster.kv.block_hash import prefix_cache_salt
from cluster.kv.block_pool import WORKER_EVENT_LOG_SIZE, PrefixCachingBlockPool
from cluster.engine.chunked_prefill import fcfs_chunks
from cluster.errors import CapacityError, InvalidRequestError
from cluster.sampling.logprobs import PrefillLogprobs
from cluster.wire.messages import KVCacheEvents, PrefillTask, Reservation, WorkerStats
from cluster.model.config import ModelArchConfig
from cluster.engine.model_runner import PrefillChunk
from cluster.engine.prefill_graph_runner import PrefillGraphRunner
from cluster.kv.request_limits import served_max_model_len
from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.text.tokenizer import load_tokenizer
from cluster.transport.base import KVSender, Shipment
from cluster.transport.plan import KVNumerics
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.worker_model import WorkerModel
from prefill_worker.abort_notices import AbortNotices
from prefill_worker.calls_ahead import CallsAhead
from prefill_worker.first_token_sender import FirstTokenSender
from prefill_worker.launched_pass import LaunchedPass
from prefill_worker.pass_launcher import PassLauncher
from prefill_worker.prefill_job import PrefillJob, check_task, failed_result, reservation_error
from prefill_worker.warmup import warm_up

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, worker_id: str, cfg: WorkerConfig, transport: KVSender | None = None,
                 send_timeout_s: float = 30.0, model=None, arch: ModelArchConfig | None = None, group=None):
        """`group`: the TPGroup this process leads (tensor parallelism), or None."""
        self.worker_id = worker_id
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        wm = WorkerModel.load(cfg, group, model=model, arch=arch)
        self.group = wm.group if group is not None and group.size > 1 else None
        self.arch = wm.arch
        self.model = wm.model
        self.spec = wm.spec
        self.runner = wm.runner
        # FP8 weights or an FP8 cache compute other K/V: the prefix-cache salt and the KV transport's
        # pair check both take this tag (the decode workers compute the same one: WorkerModel).
        self.kv_numerics = wm.kv_numerics
        self.allocator = PrefixCachingBlockPool(self.spec.num_blocks, cfg.block_size,
                                                prefix_cache_salt(cfg.model_dir, self.kv_numerics, cfg.block_size),
                                                cfg.enable_prefix_caching, event_log_size=WORKER_EVENT_LOG_SIZE)
        self._computed_tokens = 0  # prompt tokens run through the model (cache hits excluded)
        self.transport = transport
        self.send_timeout_s = send_timeout_s
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.max_model_len = served_max_model_len(cfg.max_model_len, self.arch.max_position_embeddings)
        # Short passes replay CUDA graphs (cluster/engine/prefill_graph_runner.py), captured now, before serving.
        self.graphs_off = PrefillGraphRunner.eager_reason(cfg, self.group is not None)
        self.prefill_graphs = None if self.graphs_off else PrefillGraphRunner.for_worker(wm, cfg, self.max_model_len)
        self.overlap = cfg.prefill_overlap == "on" or (cfg.prefill_overlap == "auto" and self.device.type == "cuda")
        self.prefill_tokens_total = 0
        self.warmup_info: dict = {}
        self._waiting: deque[PrefillJob] = deque()
        self._to_ship: list[PrefillJob] = []  # computed before their reservation came; it has now
        self._jobs: dict[str, PrefillJob] = {}
        self._ahead = CallsAhead()  # attach / abort calls that overtook their submit (Ray's async actor)
        self._aborts = AbortNotices(lambda: self.transport, lambda: self.send_timeout_s)
        self._sending = 0
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        if self.group is not None:  # the followers ship their heads' part of it (cluster/transport/tp_payload.py)
            self.runner.shipment_of_pass = self._shipment_for_followers
        self.grammars = GrammarCompiler(lambda: load_tokenizer(cfg.model_dir), self.arch.vocab_size,
                                        self.arch.eos_token_ids, on_ready=self._grammar_ready)
        # The first tokens go to their gateways from here (prefill_worker/first_token_sender.py).
        self.first_tokens = FirstTokenSender(worker_id, lambda: load_tokenizer(cfg.model_dir), self.arch.eos_token_ids,
                                             cfg.cluster_secret)
        self.passes = PassLauncher(self.runner, self.prefill_graphs, self.model, self.spec.num_layers, self.device)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    def _shipment_for_followers(self) -> bytes:
        ship = getattr(self.transport, "shipment_for_followers", None)
        shipment = self.passes.shipment
        return ship(shipment) if ship is not None and shipment is not None else b""

    # -- API ------------------------------------------------------------------------------------
    def start(self) -> "PrefillWorker":
        self._thread = threading.Thread(target=self._loop, name=f"prefill-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def submit(self, task: PrefillTask) -> Future:
        """Queues a prompt; the future resolves to a PrefillResult once the decode side has the KV
        (ok=False with `error` if the prefill, the transfer or an abort stopped it)."""
        fut: Future = Future()
        req, grammar, rid = task.request, None, task.request.request_id
        with self._cv:  # an attach or an abort of this prompt may have come first (calls_ahead.py)
            held, aborted_ahead = self._ahead.take(rid)
        reservation = task.reservation or held
        if task.reservation is not None:
            self._aborts.send(held, rid, "a second reservation")
        try:
            check_task(task, reservation, max_model_len=self.max_model_len, block_size=self.spec.block_size,
                       kv_blocks=self.allocator.capacity, vocab_size=self.arch.vocab_size,
                       holder=f"prefill worker {self.worker_id}")
            if req.params.structured is not None and not aborted_ahead:
                self.grammars.check(req.params.structured)
                n = len(req.prompt_token_ids)
                prior = req.prompt_token_ids[n - req.resumed_tokens:] if req.resumed_tokens else ()
                grammar = self.grammars.grammar_for(req.params.structured, rid, prior)
            error = "aborted" if aborted_ahead else None
        except (InvalidRequestError, CapacityError) as e:  # (CapacityError: its compiles are all taken)
            error = str(e)
        if error is not None:
            fut.set_result(failed_result(task, 0.0, error))
            with self._cv:
                self._ahead.ended(rid)
            self._aborts.send(reservation, rid)
            return fut
        job = PrefillJob(task, fut, time.perf_counter(), grammar=grammar, submitted_at=time.time(),
                         reservation=reservation)
        with self._cv:
            self._jobs[job.request_id] = job
            self._waiting.append(job)
            self._cv.notify()
        return fut

    def attach(self, request_id: str, reservation: Reservation) -> None:
        """The reservation of a prompt submitted without one (see the module docstring). One for a
        prompt not submitted yet waits for it; one for a prompt this worker no longer has (aborted,
        failed) is aborted at once: its decode worker frees the blocks now (calls_ahead.py)."""
        error = None
        with self._cv:
            expired = self._ahead.expired()
            job = self._jobs.get(request_id)
            if job is None and self._ahead.hold(request_id, reservation):
                pass  # its submit takes it
            elif job is None or job.aborted or job.reservation is not None:
                error = "no such prompt" if job is None or job.aborted else "attached twice"
            else:
                job.reservation = reservation
                skips = reservation_error(reservation, len(job.prompt), self.spec.block_size)
                if skips is not None:
                    self._abort_locked(job, skips)
                elif job.parked:
                    self._to_ship.append(job)
                    self._cv.notify()
        for rid, res in expired:
            self._aborts.send(res, rid, "its prompt did not come")
        if error is not None:
            self._aborts.send(reservation, request_id, error)

    def abort(self, request_id: str) -> bool:
        """A queued or computing prompt stops; its decode worker is told (header ok=False). A prompt
        whose KV is already being sent finishes the transfer. Returns whether anything was aborted
        now (a prompt not submitted yet is when it comes: calls_ahead.py)."""
        with self._cv:
            job = self._jobs.get(request_id)
            if job is not None:
                if job.aborted:
                    return False
                self._abort_locked(job, "aborted")
                return True
            held = self._ahead.abort_ahead(request_id)
        self._aborts.send(held, request_id)
        return False

    def _abort_locked(self, job: PrefillJob, error: str) -> None:
        """Under self._cv. A queued prompt not started, or a computed one waiting for its reservation,
        ends now; one in a pass ends after it (step), one whose KV is being sent finishes sending."""
        job.aborted = True
        if (job.done_tokens == 0 and not job.blocks and job in self._waiting) or job.parked:
            if job in self._waiting:
                self._waiting.remove(job)
            if job in self._to_ship:
                self._to_ship.remove(job)
            job.parked = False
            self._finish_aborted(job, error)

    def warmup(self) -> dict:
        """Before serving: every prefill shape class twice, the grammar engine (prefill_worker/warmup.py)."""
        self.warmup_info = warm_up(self.runner, self.allocator, self.spec.blocks_for_tokens, self.passes.timer, self.grammars,
                                   self.first_tokens, max_prefill_tokens=self.max_prefill_tokens,
                                   max_model_len=self.max_model_len, vocab_size=self.arch.vocab_size,
                                   device=self.device)
        return self.warmup_info

    def kv_numerics_info(self) -> KVNumerics:
        """What this cache's K/V is, for the KV transport's pair check (cluster/transport/plan.py)."""
        return KVNumerics(str(self.spec.dtype).removeprefix("torch."), self.kv_numerics)

    def set_transport(self, transport: KVSender, send_timeout_s: float | None = None) -> None:
        self.transport = transport
        if send_timeout_s is not None:
            self.send_timeout_s = send_timeout_s

    def stats(self) -> WorkerStats:
        with self._cv:
            expired = self._ahead.expired()  # (polled: a held reservation's deadline is kept within a poll)
            outstanding = sum(len(j.prompt) - j.done_tokens for j in self._waiting)
            extra = {"sending": self._sending, "computed_prompt_tokens": self._computed_tokens,
                     "calls_ahead": len(self._ahead), **self.allocator.stats_extra()}
        for rid, res in expired:
            self._aborts.send(res, rid, "its prompt did not come")
        if self.transport is not None and hasattr(self.transport, "metrics"):
            m = self.transport.metrics()
            extra.update({k: m[k] for k in ("transfers", "bytes", "seconds", "failures", "GBps")})
        if self.warmup_info:
            extra["warmup"] = self.warmup_info
        extra["prefill_graphs"] = self.prefill_graphs.summary() if self.prefill_graphs else {"off": self.graphs_off}
        extra["prefill_passes"] = {"launched": self.passes.launched, "overlapped": self.passes.overlapped}
        self.passes.timer.harvest()
        if self.group is not None:
            extra["tensor_parallel"] = self.group.describe()
        healthy = not self._stop and (self.group is None or self.group.failed is None)
        return WorkerStats(self.worker_id, "prefill", healthy=healthy, free_blocks=self.allocator.num_free,
                           total_blocks=self.allocator.capacity, running=extra["sending"],
                           waiting=len(self._waiting), outstanding_prefill_tokens=outstanding, extra=extra,
                           prefill_rate=self.passes.timer.meter.rate(), prefill_tokens_total=self.prefill_tokens_total)

    def kv_events(self, epoch: str | None, seq: int) -> KVCacheEvents:
        """How this worker's cached blocks changed since (epoch, seq) (router.placement.kv_index)."""
        with self._cv:
            pool = self.allocator
            return KVCacheEvents(self.worker_id, pool.hasher.salt, pool.block_size, pool.events_since(epoch, seq))

    def check_blocks(self) -> None:
        """Block accounting (tests): raises AssertionError on a leaked or doubly owned KV block."""
        with self._cv:
            self.allocator.check([j.blocks for j in self._jobs.values()])

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.grammars.close()
        self.first_tokens.close()
        if self.group is not None:
            self.group.close()

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        launched: LaunchedPass | None = None  # on the device, its first tokens not read yet
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._to_ship and launched is None:
                    self._cv.wait()
                if self._stop and launched is None:
                    return
                # A late shipment commits at once: it goes out between passes, never ahead of the commit of
                # a pass launched before it (and while one waits, no pass launches behind another).
                late, self._to_ship = (self._to_ship, []) if launched is None else ([], self._to_ship)
                go = self._waiting and not self._stop and (launched is None or (self.overlap and not self._to_ship))
            for job in late:
                self._ship_late(job)
            ran, nxt = self._launch(short_only=launched is not None) if go else (False, None)
            if launched is not None:
                self._complete(launched)
            elif not ran and self._waiting:
                with self._cv:  # blocks held by transfers in flight: wait for one to finish
                    self._cv.wait(timeout=0.01)
            launched = nxt

    def _schedule(self) -> list[tuple[PrefillJob, PrefillChunk]]:
        def admit(job: PrefillJob) -> bool:
            if not job.blocks:
                got = self.allocator.allocate_prompt(job.prompt, len(job.prompt), job.hashes,
                                                     lookup=job.task.request.params.reads_prefix_cache)
                if got is None:
                    return False
                job.blocks, job.cached_tokens = got
                job.done_tokens = job.cached_tokens  # the cached prefix is not computed again
                job.started = time.perf_counter()
            return True

        with self._cv:
            for rid, error in self.grammars.take_failed():
                job = self._jobs.get(rid)
                if job is not None and job in self._waiting:
                    self._waiting.remove(job)
                    self._finish_aborted(job, error)
            # A prompt whose grammar is still compiling waits for it; the others go ahead. Under tensor
            # parallelism the followers ship their heads' KV during the pass that completes a prompt
            # (no late shipment): a prompt waits for its reservation there. A prompt whose last chunk
            # is in a launched pass stays waiting until that pass completes (all its tokens are done).
            ready = [j for j in self._waiting if (j.grammar is None or j.grammar.ready())
                     and (self.group is None or j.reservation is not None) and j.done_tokens < len(j.prompt)]
            return fcfs_chunks(ready, self.max_prefill_tokens,
                               lambda j: (j.prompt, j.done_tokens, j.blocks), admit)

    def _launch(self, short_only: bool = False) -> tuple[bool, LaunchedPass | None]:
        """One packed forward and its first tokens' draw, launched with no host sync -> (whether a pass ran,
        the pass to complete: None if it failed, handled here). `short_only` (a pass is on the device): only a
        graph replay launches; an eager pass's host launches would hold back the pass ahead's first tokens."""
        chunks = self._schedule()
        if not chunks:
            return False, None
        wants = [(job.prompt, job.task.request.params.prompt_logprobs)
                 if job.task.request.params.prompt_logprobs is not None else None for job, _ in chunks]
        if short_only and not self.passes.replays_graph([c for _, c in chunks], wants):
            return False, None
        rows = [i for i, (job, c) in enumerate(chunks) if job.done_tokens + len(c.token_ids) == len(job.prompt)]
        finishing = [chunks[i][0] for i in rows]
        self.first_tokens.connect([job.task.request for job in finishing])  # before the forward: see there
        shipment = self._begin(finishing)
        try:
            launched = self.passes.launch(chunks, rows, shipment, wants, behind=short_only)
            self.prefill_tokens_total += launched.tokens
            with self._cv:  # the pool is shared with the send threads' releases
                for job, c in chunks:
                    job.done_tokens += len(c.token_ids)
                    self._computed_tokens += len(c.token_ids)
                    self.allocator.cache_full_blocks(job.blocks, job.prompt, job.hashes, c.start, job.done_tokens)
        except Exception as e:  # fail this batch, keep serving
            self._fail_pass(chunks, shipment, e)
            return True, None
        return True, launched

    def _fail_pass(self, chunks: list[tuple[PrefillJob, PrefillChunk]], shipment: Shipment | None, e: Exception) -> None:
        if self.group is not None:  # the group cannot go on (see the module docstring)
            log.exception("prefill pass of %s failed", self.worker_id)
            self.group.fail(f"prefill worker {self.worker_id} failed a pass: {type(e).__name__}: {e}")
        if shipment is not None:
            shipment.commit({})  # their decode workers free the blocks once the payload drained
        with self._cv:
            for job, _ in chunks:
                if job in self._waiting:
                    self._waiting.remove(job)
                if shipment is None or job.request_id not in shipment.futures:
                    self._release(job)
        for job, _ in chunks:
            if shipment is not None and job.request_id in shipment.futures:
                self._await_send(job, shipment, -1, f"prefill failed: {e}")
            else:
                job.future.set_result(failed_result(job.task, 0.0, f"prefill failed: {e}"))
                self._aborts.send(job.reservation, job.request_id)

    def _complete(self, p: LaunchedPass) -> None:
        """Reads a launched pass's first tokens (the host's one wait), sends them, commits the KV."""
        finishing, shipment = p.finishing, p.shipment
        try:
            tokens, logprobs = p.drawn.result() if p.drawn is not None else ([], [])  # syncs: the pass and the draw
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
            self._fail_pass(p.chunks, shipment, e)
            return
        # The draw's wait above came after the pass's end event: its device time is ready without a wait.
        device_s = self.passes.device_seconds(p) if finishing else 0.0
        first, lps, errors = {}, {}, {}
        with self._cv:
            for job, tok, lp in zip(finishing, tokens, logprobs):
                self._waiting.remove(job)
                first[job.request_id] = None if job.aborted else tok
                plp = job.prompt_logprobs
                if not job.aborted and (lp is not None or plp is not None):
                    lps[job.request_id] = PrefillLogprobs(lp, None if plp is None else tuple(plp))
        # The first tokens leave for their gateways now, before the KV commit; one that could not be
        # sent fails its prompt (first None: its decode worker frees the blocks, the router migrates).
        # A prompt dispatched before its reservation came ships later (`late`); its first token goes
        # now all the same: the client's TTFT does not wait for the decode worker's reservation.
        sent_at = self.first_tokens.send_all([(j.task.request, first[j.request_id], lps.get(j.request_id), j.grammar)
                                              for j in finishing], first, errors) if self.transport is not None else {}
        if shipment is not None:
            shipment.commit(first, lps)
        committed_at = time.time()
        for job in finishing:
            rid = job.request_id
            job.pass_points = (p.forward_done_at, sent_at.get(rid), p.host_s, device_s, p.tokens)
            if self.transport is not None and (shipment is None or rid not in shipment.futures):
                job.first_token, job.first_logprobs = first[rid], lps.get(rid)
                self._park(job, errors.get(rid, "aborted"))  # its reservation had not come: ships later
                continue
            job.timeline = job.committed(committed_at)
            tok = first[rid]
            if shipment is None:
                with self._cv:
                    self._release(job)
                job.future.set_result(failed_result(job.task, time.perf_counter() - job.submitted,
                                                   "no KV transport (init_transport first)"))
            else:
                self._await_send(job, shipment, -1 if tok is None else tok,
                                 errors.get(rid, "aborted") if tok is None else None)

    def _begin(self, jobs: list[PrefillJob]) -> Shipment | None:
        """Claims the transfers of the prompts this forward completes (before it runs)."""
        if self.transport is None or not jobs:
            return None
        # NOTE: a prompt whose reservation has not come yet is computed all the same and ships after
        # its pass (_park, _ship_late); `attach` may set one meanwhile: the shipment's futures say
        # which prompts it claimed, not the reservations read after the forward.
        with self._cv:
            sends = [j.kv_send(j.reservation, self.spec.block_size) for j in jobs if j.reservation is not None]
        return self.transport.begin(sends) if sends else None

    def _park(self, job: PrefillJob, error: str) -> None:
        """A computed prompt whose reservation had not come when its pass began ships when it has one
        (now, or at `attach`); one without a first token (aborted, or not sent) ends here."""
        with self._cv:  # (abort() takes a parked job off both ways: parked is set with the lock held)
            if job.first_token is None or job.aborted:
                self._finish_aborted(job, error)
                return
            job.parked = True
            if job.reservation is not None:
                self._to_ship.append(job)

    def _ship_late(self, job: PrefillJob) -> None:
        """The loop thread: claims, ships and commits a computed prompt's KV at once (KVSender.send)."""
        with self._cv:
            if not job.parked:
                return  # abort() finished it
            job.parked = False
        shipment = self.transport.begin([job.kv_send(job.reservation, self.spec.block_size)], layerwise=False)
        shipment.kv_done()
        rid = job.request_id
        shipment.commit({rid: job.first_token}, {rid: job.first_logprobs} if job.first_logprobs is not None else None)
        job.timeline = job.committed(time.time())
        self._await_send(job, shipment, job.first_token, None)

    def _await_send(self, job: PrefillJob, shipment: Shipment, first_token: int, error: str | None) -> None:
        """The job's result and its blocks' release wait for its transfer future."""
        done_at = time.perf_counter()
        with self._cv:
            self._sending += 1
        shipment.futures[job.request_id].add_done_callback(lambda f: self._sent(job, f, first_token, done_at, error))

    # -- transfer and completion ----------------------------------------------------------------
    def _sent(self, job: PrefillJob, fut, first_token: int, prefill_done: float, error: str | None) -> None:
        """A transport thread: the job's transfer is over (its payload left our blocks, or failed)."""
        result = job.result(fut, first_token, prefill_done, error)
        with self._cv:
            self._release(job)  # only now: nothing reads these blocks any more
            self._sending -= 1
            self._cv.notify_all()
        job.future.set_result(result)

    def _release(self, job: PrefillJob) -> None:
        if job.blocks:
            self.allocator.free(job.blocks)
            job.blocks = []
        if self._jobs.get(job.request_id) is job:  # (the id may be submitted again after an abort)
            del self._jobs[job.request_id]
            self._ahead.ended(job.request_id)

    def _finish_aborted(self, job: PrefillJob, error: str = "aborted") -> None:
        """Under self._cv. Frees the blocks and tells the decode side there is no KV for its blocks."""
        self._release(job)
        job.future.set_result(failed_result(job.task, time.perf_counter() - job.submitted, error))
        self._aborts.send(job.reservation, job.request_id)

    def _grammar_ready(self) -> None:
        """A grammar compiled (or failed): the loop may have a prompt to schedule now."""
        with self._cv:
            self._cv.notify_all()
