"""DispatchInbox: the prefill worker's end of the router's dispatch (cluster/wire/prefill_dispatch.py).

A PULL socket on the cluster's internal address, read by a thread of its own: each frame is checked
(a MAC under the cluster's secret, bound to this worker's id and incarnation: a frame from a process
without the secret, for another worker or for an earlier incarnation of this one is dropped and
counted), decoded into its PrefillTask and handed to `submit` (PrefillWorker.submit, thread-safe) at
once, on this thread: the task is queued for the prefill loop without waiting for the actor's event
loop or Ray. Its answer is read by the router through Ray (`result(call_id)`, on the actor's loop),
which may come before its frame (two channels, no order between them): the call then waits for the
frame, at most `arrival_wait_s` (a frame that never comes: the router's socket was connected to an
earlier incarnation, or the frame was dropped), and fails with the reason.

Bounded (cluster/wire/socket_bounds.py): frames of at most MAX_DISPATCH_FRAME bytes, RECV_QUEUED per
peer before any MAC is checked; at most `max_calls` calls kept (a frame past it is dropped and
counted: its result call fails when its wait ends). A call whose answer the router never asked for
(its Ray call lost) is forgotten `arrival_wait_s` after its prompt ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Callable

import msgspec
import zmq

from cluster.wire.frame_auth import PREFILL_DISPATCH, FrameVerifier
from cluster.wire.messages import PrefillResult, PrefillTask
from cluster.wire.prefill_dispatch import decode_dispatch
from cluster.wire.socket_bounds import MAX_DISPATCH_FRAME, RateLimitedLog, bound

log = logging.getLogger(__name__)

_POLL_MS = 100  # the reader's wake-up to see close(); frames wake it at once


class DispatchError(RuntimeError):
    """A dispatch whose task this worker cannot answer for (its frame never came)."""


class _Call:
    __slots__ = ("result", "arrived", "ended_at")

    def __init__(self):
        self.result: Future = Future()  # PrefillResult, chained from the prompt's own future
        self.arrived = False  # its frame came (and was handed to submit)
        self.ended_at = 0.0  # time.monotonic() when `result` resolved


class DispatchInbox:
    def __init__(self, host: str | None, name: str, submit: Callable[[PrefillTask], Future], secret: bytes,
                 receiver: str, *, arrival_wait_s: float = 30.0, max_calls: int = 65536):
        """host: the address to bind (None: an in-process endpoint, tests); receiver: this worker's id
        and incarnation, which the MAC binds."""
        self._submit = submit
        self.arrival_wait_s = arrival_wait_s
        self.max_calls = max_calls
        self._ctx = zmq.Context.instance()  # (inproc endpoints connect within one context)
        self._sock = bound(self._ctx.socket(zmq.PULL), MAX_DISPATCH_FRAME)
        self._sock.setsockopt(zmq.LINGER, 0)
        if host is None:
            self.endpoint = f"inproc://pdserve-dispatch/{name}/{id(self)}"
            self._sock.bind(self.endpoint)
        else:
            self.endpoint = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._verifier = FrameVerifier(secret, PREFILL_DISPATCH, receiver.encode())
        self._lock = threading.Lock()
        self._calls: OrderedDict[int, _Call] = OrderedDict()  # call_id -> its call, oldest first
        self.received = 0  # tasks handed to submit
        self.dropped = 0  # frames with a valid MAC that were no task, or came with the ledger full (not in `rejected`)
        self._warn = RateLimitedLog(log)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dispatch-{name}", daemon=True)

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
        with self._lock:
            call = self._calls.get(msg.call_id)
            if call is None:
                self._forget_ended_locked()
                if len(self._calls) >= self.max_calls:
                    call = None
                else:
                    call = self._calls[msg.call_id] = _Call()
            elif call.arrived:
                call = None  # (never from the router: its call ids are not reused)
            if call is not None:
                call.arrived = True
        if call is None:
            self.dropped += 1
            self._warn.warn("dropped dispatch %d: a second frame of one call, or %d calls kept already",
                            msg.call_id, self.max_calls)
            return
        self.received += 1
        try:
            fut = self._submit(msg.task)
        except Exception as e:  # noqa: BLE001 - its result call reports it
            fut = Future()
            fut.set_exception(e)
        fut.add_done_callback(lambda f, call=call: self._ended(call, f))

    def _ended(self, call: _Call, fut: Future) -> None:
        call.ended_at = time.monotonic()
        e = fut.exception()
        try:
            if e is not None:
                call.result.set_exception(e)
            else:
                call.result.set_result(fut.result())
        except InvalidStateError:
            pass  # its result call gave up (cancelled) first

    def _forget_ended_locked(self) -> None:
        """Calls ended `arrival_wait_s` ago whose answer nobody asked for (the router's Ray call lost)."""
        limit = time.monotonic() - self.arrival_wait_s
        while self._calls:
            call = next(iter(self._calls.values()))
            if not (call.result.done() and call.ended_at and call.ended_at < limit):
                return
            self._calls.popitem(last=False)

    # -- the router's Ray call (the actor's event loop) -----------------------------------------------
    async def result(self, call_id: int) -> PrefillResult:
        """The answer of dispatch `call_id`: once its prompt's KV left (or it failed). Waits for its
        frame at most `arrival_wait_s`; raises DispatchError when it did not come."""
        with self._lock:
            call = self._calls.get(call_id)
            if call is None:
                self._forget_ended_locked()
                call = self._calls[call_id] = _Call()
        waiting = asyncio.wrap_future(call.result)
        try:
            done, _ = await asyncio.wait({waiting}, timeout=self.arrival_wait_s)
            if not done and not call.arrived:
                raise DispatchError(f"dispatch {call_id} did not reach this worker within {self.arrival_wait_s:g}s")
            return await waiting
        finally:
            if not waiting.done():
                waiting.cancel()  # (only the wrapper: the prompt itself goes on)
            with self._lock:
                if self._calls.get(call_id) is call:
                    del self._calls[call_id]

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        elif not self._sock.closed:
            self._sock.close(linger=0)
