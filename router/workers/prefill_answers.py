"""PrefillAnswers: the router's answer socket, where prefill workers send the answers of the prompts
it sent them as frames (cluster/wire/prefill_dispatch.py; the sending end is
prefill_worker/dispatch_inbox.py).

One PULL socket per router, bound at construction on the cluster's internal address, read on the
router's event loop once `start()` ran there. A frame is taken only with a MAC under the cluster's
secret bound to this router (`reply_id`, drawn here: an answer meant for another router, or replayed,
is dropped and counted, `on_rejected`), and handed to the PrefillDispatcher of the worker it names
(`register`), which resolves the waiting dispatch. An answer for no registered worker, or no waiting
dispatch (given up meanwhile), is dropped. The dispatches' call ids are drawn here (`next_call_id`),
one sequence for the router: a worker id registered again (its client made anew) closes the old
dispatcher, whose waits fail, and no call id of the new one can match an answer meant for the old.

Bounded (cluster/wire/socket_bounds.py): answers of at most MAX_ANSWER_FRAME bytes, RECV_QUEUED per
worker before any MAC is checked.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Callable, Protocol

import msgspec
import zmq
import zmq.asyncio

from cluster.wire.frame_auth import PREFILL_ANSWER, FrameVerifier
from cluster.wire.prefill_dispatch import PrefillAnswer, decode_answer
from cluster.wire.socket_bounds import MAX_ANSWER_FRAME, bound, close_on_collect
from router.streams.receive_loop import received, verified


class AnswerTaker(Protocol):
    """What takes one worker's answers (router/workers/prefill_dispatcher.py: PrefillDispatcher)."""

    worker_id: str

    def answered(self, answer: PrefillAnswer) -> bool:
        """Resolves the dispatch the answer is for; False if none waits for it."""
        ...

    def close(self) -> None:
        ...

log = logging.getLogger(__name__)


class PrefillAnswers:
    def __init__(self, host: str, secret: bytes, on_rejected: Callable[[], None] | None = None):
        self.secret = secret
        self.reply_id = f"router-{uuid.uuid4().hex}"  # what the answers' MAC binds
        self._ctx = zmq.asyncio.Context()
        self._sock = bound(self._ctx.socket(zmq.PULL), MAX_ANSWER_FRAME)
        self._sock.setsockopt(zmq.LINGER, 0)
        close_on_collect(self, self._ctx, [self._sock])
        self.endpoint = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._verifier = FrameVerifier(secret, PREFILL_ANSWER, self.reply_id.encode())
        self._on_rejected = on_rejected or (lambda: None)
        self._dispatchers: dict[str, AnswerTaker] = {}
        self._call_ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self.taken = 0  # answers handed to their dispatcher
        self.dropped = 0  # answers with a valid MAC for no waiting dispatch, or no PrefillAnswer

    @property
    def rejected(self) -> int:
        return self._verifier.rejected

    def next_call_id(self) -> int:
        """A dispatch's call id: never reused by any dispatcher of this router."""
        return next(self._call_ids)

    def register(self, dispatcher: AnswerTaker) -> None:
        """Answers naming `dispatcher.worker_id` go to it; one registered before for the same id is
        closed (what waits for it fails)."""
        old = self._dispatchers.get(dispatcher.worker_id)
        self._dispatchers[dispatcher.worker_id] = dispatcher
        if old is not None and old is not dispatcher:
            old.close()

    def unregister(self, dispatcher: AnswerTaker) -> None:
        if self._dispatchers.get(dispatcher.worker_id) is dispatcher:
            del self._dispatchers[dispatcher.worker_id]

    def start(self) -> None:
        """Starts reading (on the running loop); idempotent. A dispatcher calls it before it sends."""
        if self._reader is None and not self._sock.closed:
            self._reader = asyncio.get_running_loop().create_task(self._read_all(), name="prefill-answers")

    async def _read_all(self) -> None:
        async for answer in received(self._sock, self._read, "prefill answer"):
            d = self._dispatchers.get(answer.worker_id)
            if d is not None and d.answered(answer):
                self.taken += 1
            else:
                self.dropped += 1

    async def _read(self) -> PrefillAnswer | None:
        payload = verified(self._verifier, await self._sock.recv_multipart(copy=False), "prefill answer",
                           self._on_rejected)
        if payload is None:
            return None
        try:
            return decode_answer(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped += 1
            log.warning("dropped a prefill answer frame that is no PrefillAnswer: %s", e)
            return None

    def close(self) -> None:
        """Stops reading and ends every registered dispatcher's lifeline (their waits fail)."""
        if self._reader is not None:
            self._reader.cancel()
        for d in list(self._dispatchers.values()):
            d.close()
        if not self._sock.closed:
            self._sock.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
