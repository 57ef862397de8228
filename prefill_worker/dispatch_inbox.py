"""DispatchInbox: the prefill worker's end of the router's dispatch (cluster/wire/prefill_dispatch.py).

A PULL socket on the cluster's internal address, read by a thread of its own: each frame is checked
(a MAC under the cluster's secret, bound to this worker's id and incarnation: a frame from a process
without the secret, for another worker or for an earlier incarnation of this one is dropped and
counted), decoded into its PrefillTask and handed to `submit` (PrefillWorker.submit, thread-safe) at
once, on this thread: the task is queued for the prefill loop without waiting for the actor's event
loop or Ray.

Its answer goes back as a frame too, to the router's answer socket the dispatch names, once the
prompt's future resolves (its KV left, or it failed): no Ray call reaches this process per prompt, so
nothing takes the GIL from the prefill loop while it launches a pass. A task that could not be taken
(`submit` raised, or `max_calls` dispatches are unanswered already) is answered with the error at
once. An answer that cannot be queued (the router's socket is gone or stuck) is dropped and counted:
the router's own deadline, or the worker's lifeline (PrefillWorkerAPI.lifeline), ends its wait.

Threads: frames are read on the inbox's thread; answers are sent from whichever thread resolves the
prompt's future (the prefill loop, the KV transport's), one at a time under `_send_lock` (a ZMQ socket
is not thread-safe; the lock hands it from thread to thread with a full memory barrier).

Bounded (cluster/wire/socket_bounds.py): frames of at most MAX_DISPATCH_FRAME bytes, RECV_QUEUED per
peer before any MAC is checked; answer sockets to at most MAX_ROUTERS routers (the least recently
used closed past it), each at most RECV_QUEUED answers queued.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

import msgspec
import zmq

from cluster.wire.frame_auth import PREFILL_ANSWER, PREFILL_DISPATCH, FrameSigner, FrameVerifier
from cluster.wire.messages import PrefillResult, PrefillTask
from cluster.wire.prefill_dispatch import PrefillAnswer, PrefillDispatch, decode_dispatch, encode_answer
from cluster.wire.socket_bounds import MAX_ANSWER_FRAME, MAX_DISPATCH_FRAME, RateLimitedLog, bound

log = logging.getLogger(__name__)

_POLL_MS = 100  # the reader's wake-up to see close(); frames wake it at once
_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_ROUTERS = 8  # routers answered at once (one per cluster; more only across a router's restarts)


class DispatchInbox:
    def __init__(self, host: str | None, worker_id: str, incarnation: str, submit: Callable[[PrefillTask], Future],
                 secret: bytes, *, max_calls: int = 65536):
        """host: the address to bind (None: an in-process endpoint, tests). The MAC of the frames it
        takes binds `worker_id` and `incarnation`; its answers carry both."""
        self._submit = submit
        self.worker_id, self.incarnation = worker_id, incarnation
        self._secret = secret
        self.max_calls = max_calls
        self._ctx = zmq.Context.instance()  # (inproc endpoints connect within one context)
        self._sock = bound(self._ctx.socket(zmq.PULL), MAX_DISPATCH_FRAME)
        self._sock.setsockopt(zmq.LINGER, 0)
        if host is None:
            self.endpoint = f"inproc://pdserve-dispatch/{worker_id}/{incarnation}/{id(self)}"
            self._sock.bind(self.endpoint)
        else:
            self.endpoint = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._verifier = FrameVerifier(secret, PREFILL_DISPATCH, f"{worker_id}.{incarnation}".encode())
        self._send_lock = threading.Lock()
        self._routers: OrderedDict[tuple[str, str], tuple[zmq.Socket, FrameSigner]] = OrderedDict()
        self._unanswered = 0  # tasks taken whose answer is not sent yet (under _send_lock)
        self.received = 0  # tasks handed to submit
        self.dropped = 0  # frames with a valid MAC that were no task, or came with max_calls unanswered
        self.answered = 0  # answers queued for their router
        self.answers_lost = 0  # answers that could not be queued (no such router socket, or it is stuck)
        self._warn = RateLimitedLog(log)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dispatch-{worker_id}", daemon=True)

    def start(self) -> "DispatchInbox":
        self._thread.start()
        return self

    @property
    def rejected(self) -> int:
        """Frames dropped for a missing or bad MAC (or a replay)."""
        return self._verifier.rejected

    # -- the reader thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                if not self._sock.poll(_POLL_MS):
                    continue
                while True:
                    try:
                        parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._take(parts)
        finally:
            self._sock.close(linger=0)

    def _take(self, parts) -> None:
        payload = self._verifier.open(parts)
        if payload is None:
            self._warn.warn("dropped a dispatch frame without a valid MAC for this worker (%d so far)",
                            self._verifier.rejected)
            return
        try:
            msg = decode_dispatch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            self.dropped += 1
            self._warn.warn("dropped a dispatch frame that is no PrefillDispatch: %s", e)
            return
        with self._send_lock:
            full = self._unanswered >= self.max_calls
            if not full:
                self._unanswered += 1
        if full:
            self.dropped += 1
            self._answer(msg, None, f"DispatchFull: prefill worker {self.worker_id} holds {self.max_calls} "
                                    "unanswered dispatches already", taken=False)
            return
        self.received += 1
        if msg.reply_to:
            # Connected now, not when the answer is ready: the handshake with the router's answer socket
            # overlaps the prompt's pass instead of holding its answer (a first answer on a fresh socket
            # waited for the TCP connect and ZMTP handshake, after the KV had left). A bad endpoint is
            # reported when the answer cannot be sent.
            with self._send_lock:
                try:
                    self._router_socket(msg.reply_to, msg.reply_id)
                except (zmq.ZMQError, ValueError):
                    pass
        try:
            fut = self._submit(msg.task)
        except Exception as e:  # noqa: BLE001 - answered with the error
            self._answer(msg, None, f"{type(e).__name__}: {e}")
            return
        fut.add_done_callback(lambda f, msg=msg: self._ended(msg, f))

    # -- answers: any thread --------------------------------------------------------------------------
    def _ended(self, msg: PrefillDispatch, fut: Future) -> None:
        e = fut.exception()
        if e is not None:
            self._answer(msg, None, f"{type(e).__name__}: {e}")
        else:
            self._answer(msg, fut.result(), None)

    def _answer(self, msg: PrefillDispatch, result: PrefillResult | None, error: str | None,
                taken: bool = True) -> None:
        frame = encode_answer(PrefillAnswer(self.worker_id, self.incarnation, msg.call_id, result, error))
        with self._send_lock:
            if taken:
                self._unanswered -= 1
            if not msg.reply_to:
                return  # nobody waits for it
            try:
                sock, signer = self._router_socket(msg.reply_to, msg.reply_id)
                # NOTE: never blocks the thread that resolved the prompt (the prefill loop's).
                sock.send_multipart(signer.sign(frame), zmq.NOBLOCK)
                self.answered += 1
                return
            except (zmq.ZMQError, ValueError) as e:
                self.answers_lost += 1
                why = e
        self._warn.warn("the answer of dispatch %d (%s) was not sent to %s: %s", msg.call_id,
                        result.request_id if result is not None else error, msg.reply_to, why)

    def _router_socket(self, reply_to: str, reply_id: str) -> tuple[zmq.Socket, FrameSigner]:
        """(Under _send_lock.) The PUSH socket to a router's answer socket, connected on first use."""
        key = (reply_to, reply_id)
        got = self._routers.get(key)
        if got is not None:
            self._routers.move_to_end(key)
            return got
        if self._closed.is_set():
            raise ValueError("the inbox is closed")
        if not reply_to.startswith(_SCHEMES):
            raise ValueError(f"no ZMQ endpoint: {reply_to[:80]!r}")
        sock = bound(self._ctx.socket(zmq.PUSH), MAX_ANSWER_FRAME)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(reply_to)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        got = self._routers[key] = (sock, FrameSigner(self._secret, PREFILL_ANSWER, reply_id.encode()))
        while len(self._routers) > MAX_ROUTERS:
            _, (old, _) = self._routers.popitem(last=False)
            old.close(linger=0)
        return got

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        elif not self._sock.closed:
            self._sock.close(linger=0)
        with self._send_lock:
            for sock, _ in self._routers.values():
                sock.close(linger=0)
            self._routers.clear()
