"""WorkerClient: the router's handle on one worker.

Its methods are the worker interface the router uses (cluster.worker_api: WorkerAPI, DecodeWorkerAPI,
PrefillWorkerAPI), awaitable and each under its own timeout, so that every call the router makes is
a typed method call: `await client.reserve(ReserveRequest(...), timeout=30.0)`. The handle is a Ray
actor handle (each call goes out as `handle.<method>.remote(...)`) or, in unit tests, a plain
in-process object (sync or async methods). tests/cluster/test_worker_api.py checks that these
signatures are the Protocols' and the actors'.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

from cluster.wire.messages import (GenerateRequest, KVCacheEvents, PrefillResult, PrefillTask, Reservation, ReserveRequest,
                              WorkerStats)
from router.workers.prefill_answers import PrefillAnswers
from router.workers.prefill_dispatcher import PrefillDispatcher

try:  # the router runs without Ray in unit tests; with Ray, a dead actor is recognised at once
    from ray.exceptions import RayActorError as ActorDead
except ImportError:  # pragma: no cover
    class ActorDead(Exception):  # type: ignore[no-redef]
        pass


async def with_timeout(aw, timeout: float | None):
    """`await aw`, failing with TimeoutError after `timeout` s. Not asyncio.wait_for: on Python 3.11
    it can swallow a cancellation that arrives while its inner future completes (the awaiting task
    then runs on as if never cancelled). asyncio.timeout (3.11+) counts cancellations and has no such
    window."""
    if not timeout:
        return await aw
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover (Python 3.10)


async def call_worker(method: Callable, *args, timeout: float | None):
    """One call of a bound method of a worker's handle (an actor method or a local one)."""
    if hasattr(method, "remote"):
        result = method.remote(*args)
    else:
        result = method(*args)
        if not inspect.isawaitable(result):
            return result
    return await with_timeout(result, timeout)


class WorkerClient:
    def __init__(self, worker_id: str, role: str, handle: Any, *, answers: PrefillAnswers | None = None):
        """answers: the router's answer socket, to send a prefill worker its prompts as signed frames
        and take their answers back the same way (router/workers/prefill_dispatcher.py) once its stats
        named its dispatch socket; None: every prompt is a Ray call (`submit`)."""
        self.worker_id = worker_id
        self.role = role  # "prefill" | "decode"
        self.handle = handle
        self._dispatch = None
        if role == "prefill" and answers is not None:
            # (read when a worker names its dispatch socket: the router's test fakes have none, nor this)
            self._dispatch = PrefillDispatcher(worker_id, answers,
                                               lambda incarnation: call_worker(handle.lifeline, incarnation, timeout=None),
                                               is_death=lambda e: isinstance(e, ActorDead))

    _call = staticmethod(call_worker)

    # -- both roles (WorkerAPI) ---------------------------------------------------------------------
    async def stats(self, *, timeout: float | None = None) -> WorkerStats:
        stats = await self._call(self.handle.stats, timeout=timeout)
        if self._dispatch is not None:
            self._dispatch.follow(stats.extra)  # (a restarted worker names its new socket)
        return stats

    async def kv_events(self, epoch: str | None, seq: int, *, timeout: float | None = None) -> KVCacheEvents:
        return await self._call(self.handle.kv_events, epoch, seq, timeout=timeout)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        await self._call(self.handle.abort, request_id, timeout=timeout)

    async def peer_died(self, peer: str, why: str, *, timeout: float | None = None) -> None:
        await self._call(self.handle.peer_died, peer, why, timeout=timeout)

    # -- decode workers (DecodeWorkerAPI) -------------------------------------------------------------
    async def fail(self, request_id: str, error: str, *, timeout: float | None = None) -> None:
        await self._call(self.handle.fail, request_id, error, timeout=timeout)

    async def reserve(self, req: ReserveRequest, *, timeout: float | None = None) -> Reservation | None:
        return await self._call(self.handle.reserve, req, timeout=timeout)

    async def submit_local(self, req: GenerateRequest, *, timeout: float | None = None) -> int | None:
        return await self._call(self.handle.submit_local, req, timeout=timeout)

    async def lost(self, request_id: str, *, timeout: float | None = None) -> bool:
        return await self._call(self.handle.lost, request_id, timeout=timeout)

    # -- prefill workers (PrefillWorkerAPI) -----------------------------------------------------------
    async def submit(self, task: PrefillTask, *, timeout: float | None = None) -> PrefillResult:
        sent = self._dispatch.send(task) if self._dispatch is not None else None
        if sent is None:
            return await self._call(self.handle.submit, task, timeout=timeout)
        # The task is on its way as a frame, and its answer will be one: it fails at once if the
        # worker dies or restarts meanwhile (its lifeline ends), as the submit call did.
        call_id, answer = sent
        try:
            return await with_timeout(answer, timeout)
        finally:
            self._dispatch.forget(call_id)

    async def attach(self, request_id: str, reservation: Reservation, *, timeout: float | None = None) -> None:
        await self._call(self.handle.attach, request_id, reservation, timeout=timeout)
