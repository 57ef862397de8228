"""PrefillDispatcher: the router's end of one prefill worker's dispatch socket
(cluster/wire/prefill_dispatch.py; the worker's end is prefill_worker/dispatch_inbox.py).

It follows the worker's stats (WorkerClient.stats hands it each answer's `extra`): the endpoint and
incarnation the worker reports there, through Ray, are where its frames go and what their MAC binds.
A restarted worker reports a new pair; the old socket is closed and a new one connected, so a frame
never goes to an incarnation that would not know its call. Until the worker's first stats answer
(and with no endpoint reported) `send` returns None: the caller dispatches through Ray instead.

One PUSH socket per worker, used on the router's event loop only (ZMQ sockets are not thread-safe).
A send never blocks: a worker that stopped reading (SNDHWM frames queued) fails the dispatch with
zmq.Again, which the walk takes as a failed call to that worker.
"""

from __future__ import annotations

import itertools
import weakref

import zmq

from cluster.wire.frame_auth import PREFILL_DISPATCH, FrameSigner
from cluster.wire.messages import PrefillTask
from cluster.wire.prefill_dispatch import PrefillDispatch, encode_dispatch
from cluster.wire.socket_bounds import MAX_DISPATCH_FRAME, RECV_QUEUED, bound

_SCHEMES = ("tcp://", "inproc://")


class PrefillDispatcher:
    def __init__(self, worker_id: str, secret: bytes):
        self.worker_id = worker_id
        self._secret = secret
        self._ctx = zmq.Context.instance()  # (the worker's inproc endpoint, in tests, is in this context)
        self._ids = itertools.count(1)  # call ids: one per dispatch, never reused (across incarnations too)
        self.endpoint: str | None = None
        self.incarnation: str | None = None
        self._sock: zmq.Socket | None = None
        self._signer: FrameSigner | None = None
        self.sent = 0

    def follow(self, extra: dict) -> None:
        """The worker's latest stats (`WorkerStats.extra`): connects to the endpoint of the incarnation
        they name, when it is not the one connected."""
        endpoint, incarnation = extra.get("dispatch"), extra.get("incarnation")
        if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES) or not isinstance(incarnation, str):
            return
        if (endpoint, incarnation) == (self.endpoint, self.incarnation):
            return
        self.close()
        sock = bound(self._ctx.socket(zmq.PUSH), MAX_DISPATCH_FRAME, RECV_QUEUED)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        weakref.finalize(self, sock.close, 0)
        self._sock, self.endpoint, self.incarnation = sock, endpoint, incarnation
        self._signer = FrameSigner(self._secret, PREFILL_DISPATCH, f"{self.worker_id}.{incarnation}".encode())

    def send(self, task: PrefillTask) -> tuple[int, str] | None:
        """Sends the task; returns (its call id, the incarnation it went to), to ask the worker for its
        result with, or None when no endpoint is known (dispatch through Ray)."""
        if self._sock is None:
            return None
        call_id = next(self._ids)
        # NOTE: never blocks the router's loop (zmq.Again when SNDHWM frames wait for the worker).
        self._sock.send_multipart(self._signer.sign(encode_dispatch(PrefillDispatch(call_id, task))), zmq.NOBLOCK)
        self.sent += 1
        return call_id, self.incarnation

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._signer = None
        self.endpoint = self.incarnation = None
