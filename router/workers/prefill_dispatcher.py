"""PrefillDispatcher: the router's end of one prefill worker's dispatch (cluster/wire/prefill_dispatch.py;
the worker's end is prefill_worker/dispatch_inbox.py, the answers come through
router/workers/prefill_answers.py).

It follows the worker's stats (WorkerClient.stats hands it each answer's `extra`): the endpoint and
incarnation the worker reports there, through Ray, are where its frames go and what their MAC binds.
A restarted worker reports a new pair; the old socket is closed and a new one connected, so a frame
never goes to an incarnation that would not know its call. Until the worker's first stats answer
(and with no endpoint reported) `send` returns None: the caller dispatches through Ray instead.

Each dispatch waits for its answer frame. What a Ray call per prompt gave besides, a failure at once
when the actor dies, comes from the worker's lifeline: one Ray call per incarnation followed
(PrefillWorkerAPI.lifeline) that ends only when the worker shuts down, dies or restarts; every
dispatch still waiting then fails with its error (a dead actor's: the router's health check marks the
worker dead at once, as before). A lifeline call that fails otherwise (`is_death` says which errors
are a death) fails nothing: the answers may still come, each dispatch's own timeout bounds its wait.
Either way `send` returns None (dispatch through Ray) until a stats answer re-arms the lifeline.

Call ids come from the router's PrefillAnswers, one sequence for every dispatcher, so an answer can
never resolve another dispatcher's call of the same number.

One PUSH socket per worker, used on the router's event loop only (ZMQ sockets are not thread-safe).
A send never blocks: a worker that stopped reading (SNDHWM frames queued) fails the dispatch with
zmq.Again, which the walk takes as a failed call to that worker.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Awaitable, Callable

import zmq

from cluster.wire.frame_auth import PREFILL_DISPATCH, FrameSigner
from cluster.wire.messages import PrefillTask
from cluster.wire.prefill_dispatch import PrefillAnswer, PrefillDispatch, encode_dispatch
from cluster.wire.socket_bounds import MAX_DISPATCH_FRAME, RECV_QUEUED, bound
from router.workers.prefill_answers import PrefillAnswers

log = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "inproc://")


class PrefillCallFailed(RuntimeError):
    """The worker answered a dispatch with an error (it could not take the task), or its lifeline
    ended with one pending."""


class PrefillDispatcher:
    def __init__(self, worker_id: str, answers: PrefillAnswers, lifeline: Callable[[str], Awaitable[str]],
                 is_death: Callable[[BaseException], bool]):
        """lifeline(incarnation): the worker's PrefillWorkerAPI.lifeline call; is_death(error): whether an
        error it raised says the actor died (Ray's RayActorError)."""
        self.worker_id = worker_id
        self._answers = answers
        self._lifeline_call = lifeline
        self._is_death = is_death
        self._ctx = zmq.Context.instance()  # (the worker's inproc endpoint, in tests, is in this context)
        self.endpoint: str | None = None
        self.incarnation: str | None = None
        self._sock: zmq.Socket | None = None
        self._signer: FrameSigner | None = None
        self._lifeline: asyncio.Task | None = None  # of the incarnation followed; done: no frames until re-armed
        self._waiting: dict[int, asyncio.Future] = {}  # call id -> its answer (of the incarnation followed)
        self.sent = 0
        answers.register(self)

    def follow(self, extra: dict) -> None:
        """The worker's latest stats (`WorkerStats.extra`; on the router's loop): connects to the
        endpoint of the incarnation they name, when it is not the one connected, and keeps its lifeline
        pending."""
        endpoint, incarnation = extra.get("dispatch"), extra.get("incarnation")
        if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES) or not isinstance(incarnation, str):
            return
        if (endpoint, incarnation) != (self.endpoint, self.incarnation):
            self._disconnect(f"prefill worker {self.worker_id} restarted (incarnation {incarnation})")
            sock = bound(self._ctx.socket(zmq.PUSH), MAX_DISPATCH_FRAME, RECV_QUEUED)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            weakref.finalize(self, sock.close, 0)
            self._sock, self.endpoint, self.incarnation = sock, endpoint, incarnation
            self._signer = FrameSigner(self._answers.secret, PREFILL_DISPATCH, f"{self.worker_id}.{incarnation}".encode())
        if self._lifeline is None or self._lifeline.done():
            self._answers.start()
            self._lifeline = asyncio.get_running_loop().create_task(self._watch(incarnation),
                                                                    name=f"lifeline-{self.worker_id}")

    async def _watch(self, incarnation: str) -> None:
        # (Cancelled by _disconnect, which failed what waited: what waits now is another incarnation's.)
        try:
            why: BaseException = PrefillCallFailed(f"prefill worker {self.worker_id} {await self._lifeline_call(incarnation)}")
        except Exception as e:  # noqa: BLE001 - a dead actor's error, as a Ray call per prompt would get it
            why = e
        if incarnation != self.incarnation:
            return
        if not isinstance(why, PrefillCallFailed) and not self._is_death(why):
            log.warning("prefill worker %s incarnation %s: its lifeline call failed (%s: %s); %d dispatches "
                        "still wait for their answers", self.worker_id, incarnation, type(why).__name__, why,
                        len(self._waiting))
            return  # (done: the next stats answer re-arms it)
        log.info("prefill worker %s incarnation %s: its lifeline ended (%s: %s); %d dispatches waiting fail",
                 self.worker_id, incarnation, type(why).__name__, why, len(self._waiting))
        self._fail_waiting(why)

    def send(self, task: PrefillTask) -> tuple[int, asyncio.Future] | None:
        """Sends the task (on the router's loop); returns (its call id, the future of its PrefillResult),
        or None when no live incarnation is followed (dispatch through Ray)."""
        if self._sock is None or self._lifeline is None or self._lifeline.done():
            return None
        call_id = self._answers.next_call_id()
        frame = PrefillDispatch(call_id, task, self._answers.endpoint, self._answers.reply_id)
        # NOTE: never blocks the router's loop (zmq.Again when SNDHWM frames wait for the worker).
        self._sock.send_multipart(self._signer.sign(encode_dispatch(frame)), zmq.NOBLOCK)
        fut = self._waiting[call_id] = asyncio.get_running_loop().create_future()
        self.sent += 1
        return call_id, fut

    def forget(self, call_id: int) -> None:
        """The caller stopped waiting (answered, timed out, cancelled)."""
        self._waiting.pop(call_id, None)

    def answered(self, answer: PrefillAnswer) -> bool:
        """An answer frame (PrefillAnswers, on the loop); False if no dispatch waits for it."""
        if answer.incarnation != self.incarnation:
            return False
        fut = self._waiting.pop(answer.call_id, None)
        if fut is None or fut.done():
            return False
        if answer.result is not None:
            fut.set_result(answer.result)
        else:
            fut.set_exception(PrefillCallFailed(answer.error or "no answer"))
        return True

    def _fail_waiting(self, why: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(why)

    def _disconnect(self, why: str) -> None:
        if self._lifeline is not None and not self._lifeline.done():
            self._lifeline.cancel()
        self._lifeline = None
        self._fail_waiting(PrefillCallFailed(why))
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._signer = None
        self.endpoint = self.incarnation = None

    def close(self) -> None:
        self._disconnect(f"the router stopped following prefill worker {self.worker_id}")
        self._answers.unregister(self)

