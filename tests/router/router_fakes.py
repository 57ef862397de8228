"""Test doubles of the prefill and decode workers, with the real actors' APIs.

`FakeDecodeWorker` runs `cluster.engine.engine.LLMEngine` on its own thread and hands one TokenBatch per
engine step to the real `TokenPublisher` (detokenization, stop strings, each gateway's text over
ZMQ), exactly like the real decode worker; its greedy outputs are the reference engine's by
construction. Reservations hold KV blocks
until the (fake) prefill worker reports the transfer, so admission, placement and abort-frees-blocks
are exercised against real block accounting. `FakePrefillWorker` waits `prefill_delay_s` and for the
reservation the router hands it (`attach`), then tells its decode worker that the KV landed (the
decode engine recomputes the prompt itself); a reservation for a prompt it no longer has is aborted
there, as the real prefill worker's is.

They work as Ray actors (the launcher wraps them with ray.remote) and as plain objects.

`StubWorker` has no model at all: stats it is told to report, placements it records. The unit tests
of the router's parts (health, placement walk, migration) run on it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import replace

from cluster.engine.engine import LLMEngine
from cluster.wire.messages import (GenerateRequest, PrefillResult, PrefillTask, Reservation, ReserveRequest, TokenBatch,
                              TokenDelta, WorkerStats)
from cluster.engine.sequence import SequenceStatus
from cluster.worker.worker_config import WorkerConfig
from decode_worker.token_publisher import TokenPublisher
from prefill_worker.calls_ahead import CallsAhead


class FakeDecodeWorker:
    def __init__(self, worker_id: str, cfg: WorkerConfig, stats_sink: str | None, step_delay_s: float = 0.0):
        self.worker_id = worker_id
        self.engine = LLMEngine(cfg.model_dir, block_size=cfg.block_size, num_blocks=cfg.num_blocks or cfg.cpu_num_blocks,
                                max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens)
        self.step_delay_s = step_delay_s
        self.publisher = TokenPublisher(worker_id, self.engine.tokenizer, stats_sink, on_stop=self.abort,
                                        secret=cfg.cluster_secret)
        self._lock = threading.Lock()
        self._reserved: dict[str, tuple[GenerateRequest, int]] = {}
        self._tracked: dict[str, tuple[object, int]] = {}  # request id -> (Sequence, tokens emitted)
        self._seq = itertools.count()
        self._transfer_seq: dict[str, itertools.count] = {}
        self._steps = itertools.count()
        self._stop = threading.Event()
        self.reserve_calls = 0
        self.local_submits = 0
        self.refusing = False  # refuse every placement although blocks are free (a full batch, say)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    # -- the actor API ------------------------------------------------------------------------------
    def _blocks(self, req: GenerateRequest) -> int:
        return self.engine.spec.blocks_for_tokens(len(req.prompt_token_ids) + 1)

    def _free_locked(self) -> int:
        pending = sum(n for _, n in self._reserved.values())
        pending += sum(self.engine.spec.blocks_for_tokens(s.num_tokens + 1) for s in self.engine.waiting if not s.block_table)
        return self.engine.allocator.num_free - pending

    def reserve(self, rr: ReserveRequest) -> Reservation | None:
        with self._lock:
            self.reserve_calls += 1
            need = self._blocks(rr.request)
            if self.refusing or self._free_locked() < need:
                return None
            self.publisher.register(rr.request)
            self._reserved[rr.request.request_id] = (rr.request, need)
            seq = next(self._transfer_seq.setdefault(rr.prefill_worker_id, itertools.count()))
            return Reservation(rr.request.request_id, self.worker_id, tuple(range(1, need + 1)), seq)

    def kv_arrived(self, request_id: str, ok: bool) -> None:
        with self._lock:
            entry = self._reserved.pop(request_id, None)
            if entry is not None and ok:
                self._add_locked(entry[0])
            elif entry is not None:
                self.publisher.forget(request_id)

    def submit_local(self, req: GenerateRequest) -> int | None:
        """None when it does not fit; else 0 (the engine looks its cache up later, when it schedules)."""
        with self._lock:
            if self.refusing or self._free_locked() < self._blocks(req):
                return None
            self.local_submits += 1
            self.publisher.register(req)
            self._add_locked(req)
            return 0

    def _add_locked(self, req: GenerateRequest) -> None:
        params = replace(req.params, seed=req.seed, stop=())  # stop strings are the publisher's
        seq = self.engine.add_request(list(req.prompt_token_ids), params, request_id=req.request_id)
        self._tracked[req.request_id] = (seq, 0)

    def abort(self, request_id: str, error: str | None = None) -> None:
        with self._lock:
            reserved = self._reserved.pop(request_id, None)
            entry = self._tracked.pop(request_id, None)
            if reserved is not None or entry is not None:  # ends its publisher state, like the real worker
                end = TokenDelta(request_id, (), "abort") if error is None else TokenDelta(request_id, (), "error", error)
                self.publisher.publish(TokenBatch(self.worker_id, -1, (end,)))
            if entry is None:
                return
            seq = entry[0]
            e = self.engine
            if seq in e.waiting:
                e.waiting.remove(seq)
            if seq in e.running:
                e.running.remove(seq)
            if seq.block_table:
                e.allocator.free(seq.block_table)
                seq.block_table = []
            seq.status = SequenceStatus.FINISHED

    def fail(self, request_id: str, error: str) -> None:
        self.abort(request_id, error)

    def stats(self) -> WorkerStats:
        with self._lock:
            e = self.engine
            return WorkerStats(self.worker_id, "decode", True, free_blocks=max(0, self._free_locked()),
                               total_blocks=e.allocator.capacity, running=len(e.running),
                               waiting=len(e.waiting) + len(self._reserved), max_num_seqs=e.max_num_seqs)

    def step_metrics(self) -> dict:
        return {}

    def check_blocks(self) -> None:
        with self._lock:
            e = self.engine
            e.allocator.check([s.block_table for s in (*e.running, *e.waiting)])

    def init_transport(self, spec) -> None:
        pass

    def refuse_placements(self, on: bool) -> None:
        self.refusing = on

    def set_step_delay(self, seconds: float) -> None:
        self.step_delay_s = seconds

    def counters(self) -> dict:
        return {"reserve_calls": self.reserve_calls, "local_submits": self.local_submits}

    def poll_token_batches(self, timeout: float = 0.0) -> list:
        return self.publisher.drain(timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publisher.close()

    # -- the decode loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self.engine.has_work():
                    batch = None
                else:
                    t0 = time.perf_counter()
                    finished = set(id(s) for s in self.engine.step())
                    batch = TokenBatch(self.worker_id, next(self._steps), self._deltas_locked(finished),
                                       time.perf_counter() - t0, len(self.engine.running), 0)
            if batch is None:
                time.sleep(0.002)
                continue
            if batch.deltas:
                self.publisher.publish(batch)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)

    def _deltas_locked(self, finished: set[int]) -> tuple[TokenDelta, ...]:
        deltas = []
        for rid, (seq, emitted) in list(self._tracked.items()):
            new = tuple(seq.output_token_ids[emitted:])
            done = id(seq) in finished
            if new or done:
                p = seq.params
                lps = tuple(seq.output_logprobs[emitted:]) if p.logprobs is not None else None
                prompt_lps = tuple(seq.prompt_logprobs or ()) if p.prompt_logprobs is not None and emitted == 0 else None
                deltas.append(TokenDelta(rid, new, seq.finish_reason if done else None, None, lps, prompt_lps))
                self._tracked[rid] = (seq, emitted + len(new))
            if done:
                del self._tracked[rid]
        return tuple(deltas)


class _FakePrefillJob:
    """One submission of a prompt to the prefill double (an id may be submitted again while its
    earlier submission, aborted, is still winding down)."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.reservation: asyncio.Future = asyncio.get_running_loop().create_future()  # None: aborted
        self.aborted = False


class FakePrefillWorker:
    """Prefill double: after `prefill_delay_s`, tells the reserving decode worker the KV landed. Its
    attach and abort may come before their submit, as the real worker's (prefill_worker/calls_ahead.py)."""

    def __init__(self, worker_id: str, cfg: WorkerConfig, prefill_delay_s: float = 0.01):
        self.worker_id = worker_id
        self.prefill_delay_s = prefill_delay_s
        self.decode: dict = {}
        self._jobs: dict[str, _FakePrefillJob] = {}
        self._ahead = CallsAhead()
        self.submitted = 0

    def init_transport(self, spec: dict) -> None:
        self.decode = spec["decode"]

    async def _notify(self, decode_id: str, request_id: str, ok: bool) -> None:
        fn = self.decode[decode_id].kv_arrived
        if hasattr(fn, "remote"):
            await fn.remote(request_id, ok)
        else:
            fn(request_id, ok)

    async def submit(self, task: PrefillTask) -> PrefillResult:
        rid = task.request.request_id
        self.submitted += 1
        held, aborted_ahead = self._ahead.take(rid)
        reservation = task.reservation or held
        if aborted_ahead:
            self._ahead.ended(rid)
            if reservation is not None:
                await self._notify(reservation.decode_worker_id, rid, False)
            return PrefillResult(rid, -1, 0.0, 0.0, 0.0, 0, ok=False, error="aborted")
        job = self._jobs[rid] = _FakePrefillJob(len(task.request.prompt_token_ids))
        if reservation is not None:
            job.reservation.set_result(reservation)
        t0 = time.perf_counter()
        try:
            await asyncio.sleep(self.prefill_delay_s)
            t1 = time.perf_counter()
            reservation = await job.reservation  # None: aborted before it came
            ok = not job.aborted and reservation is not None
            if reservation is not None:
                await self._notify(reservation.decode_worker_id, rid, ok)
            t2 = time.perf_counter()
        finally:
            if self._jobs.get(rid) is job:
                del self._jobs[rid]
                self._ahead.ended(rid)
        if not ok:
            return PrefillResult(rid, -1, 0.0, t1 - t0, 0.0, 0, ok=False, error="aborted")
        nbytes = len(reservation.block_ids) * 4096
        return PrefillResult(rid, -1, 0.0, t1 - t0, t2 - t1, nbytes)

    async def attach(self, request_id: str, reservation: Reservation) -> None:
        for rid, res in self._ahead.expired():
            await self._notify(res.decode_worker_id, rid, False)
        job = self._jobs.get(request_id)
        if job is None and self._ahead.hold(request_id, reservation):
            return  # its submit takes it
        if job is None or job.aborted or job.reservation.done():
            await self._notify(reservation.decode_worker_id, request_id, False)  # no KV will come
            return
        job.reservation.set_result(reservation)

    def abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.aborted = True
            if not job.reservation.done():
                job.reservation.set_result(None)
            return
        held = self._ahead.abort_ahead(request_id)
        if held is not None:  # (on the event loop: the router's, or the actor's)
            asyncio.get_running_loop().create_task(self._notify(held.decode_worker_id, request_id, False))

    def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, "prefill", True, waiting=len(self._jobs),
                           outstanding_prefill_tokens=sum(j.tokens for j in self._jobs.values()))

    def counters(self) -> dict:
        return {"submitted": self.submitted}

    def shutdown(self) -> None:
        pass


class StubWorker:
    """A worker of either role with no model: answers the worker interface the router uses from
    fields a test sets, and records every call."""

    def __init__(self, worker_id: str, role: str, free_blocks: int = 100, total_blocks: int = 100):
        self.worker_id, self.role = worker_id, role
        self.free_blocks, self.total_blocks = free_blocks, total_blocks
        self.incarnation = "i0"
        self.healthy = True
        self.fail: BaseException | None = None  # raised by every call (a dead or hung worker)
        self.refuse = False  # reserve / submit_local answer None (full)
        self.prefill_ok = True
        self.lost_ids: set[str] = set()
        self.prefill_rate = self.decode_rate = None  # cluster.worker.pass_rate.PassRate, as measured
        self.calls: list[tuple] = []
        # Prompts submitted without a reservation, answered once `attach` brings one (or `abort`).
        self.unattached: dict[str, asyncio.Future] = {}
        self.orphans: list[str] = []  # reservations attached for a prompt it no longer had (aborted)

    def _called(self, *call) -> None:
        self.calls.append(call)
        if self.fail is not None:
            raise self.fail

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def stats(self) -> WorkerStats:
        self._called("stats")
        return WorkerStats(self.worker_id, self.role, self.healthy, self.free_blocks, self.total_blocks,
                           max_num_seqs=8, extra={"incarnation": self.incarnation}, prefill_rate=self.prefill_rate,
                           decode_rate=self.decode_rate)

    def reserve(self, rr: ReserveRequest) -> Reservation | None:
        self._called("reserve", rr.request.request_id, rr.prefill_worker_id)
        if self.refuse:
            return None
        return Reservation(rr.request.request_id, self.worker_id, (1, 2), len(self.calls))

    def submit_local(self, req: GenerateRequest) -> int | None:
        self._called("submit_local", req)
        return None if self.refuse else 0

    async def submit(self, task: PrefillTask) -> PrefillResult:
        self._called("submit", task.request.request_id)
        rid = task.request.request_id
        if not self.prefill_ok:
            return PrefillResult(rid, -1, 0.0, 0.0, 0.0, 0, ok=False, error="prefill broke")
        if task.reservation is None:  # as the real worker: the KV leaves once the reservation came
            waiting = self.unattached[rid] = asyncio.get_running_loop().create_future()
            try:
                if not await waiting:
                    return PrefillResult(rid, -1, 0.0, 0.0, 0.0, 0, ok=False, error="aborted")
            finally:
                if self.unattached.get(rid) is waiting:
                    del self.unattached[rid]
        return PrefillResult(rid, 7, 0.0, 0.001, 0.0, 0)

    def attach(self, request_id: str, reservation: Reservation) -> None:
        self._called("attach", request_id, reservation.decode_worker_id)
        waiting = self.unattached.get(request_id)
        if waiting is None or waiting.done():
            self.orphans.append(request_id)
        else:
            waiting.set_result(True)

    def abort(self, request_id: str) -> None:
        self._called("abort", request_id)
        waiting = self.unattached.get(request_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(False)

    def fail(self, request_id: str, error: str) -> None:
        self._called("fail", request_id, error)

    def peer_died(self, peer: str, why: str) -> None:
        self._called("peer_died", peer)

    def lost(self, request_id: str) -> bool:
        self._called("lost", request_id)
        return request_id in self.lost_ids


def fake_transport_group(prefill: dict, decode: dict, cfg, **_) -> None:
    """The launcher's transport-forming hook for the fakes: prefill workers learn the decode handles."""
    import ray

    ray.get([h.init_transport.remote({"decode": decode}) for h in prefill.values()])


def real_decode_actor_class():
    from decode_worker.actor import DecodeWorkerActor

    return DecodeWorkerActor
