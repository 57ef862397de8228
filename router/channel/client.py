"""RouterClient: a gateway process's end of its channel to the router (router/channel/messages.py).

Calls (submit, migrate, query) await the router's `Reply` and raise the error class a refusal names
(`error_from_wire`); the rest are one-way frames that never block the event loop. What the router
pushes is handed to the gateway: the failures of its requests (`on_failed`), their prompts'
prefix-cache hits (`on_prefilled`), the drain (`on_drain`), and the cluster state, kept in `state`
for /health and /ready. A heartbeat tells the router this gateway is alive (and how many streams and
tasks it holds); a gateway whose heartbeats stop has its requests aborted by the router.

Heartbeats leave from a thread on a socket of their own, never from the event loop: a loop busy for
seconds with one request (a huge chat template, a JSON body to parse) must not make the router
abort every other request of this process. The loop's own tick (every `heartbeat_s`) refreshes what
the heartbeat reports and when it last ran (`loop_lag_s`): the router retires a gateway whose
heartbeats stop (the process died) or whose loop has not ticked for far longer (it is wedged).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from typing import Callable

import zmq
import zmq.asyncio

from cluster.wire.messages import GenerateRequest
from cluster.wire.socket_bounds import close_on_collect
from router.channel.messages import (ClusterState, Drain, FirstToken, Finish, Goodbye, Heartbeat, Hello, Migrate,
                                     PrefillDone, Query, Reply, RequestFailed, Submit, decode_to_gateway, encode,
                                     error_from_wire)
from router.errors import RouterUnavailableError

log = logging.getLogger(__name__)


class RouterClient:
    def __init__(self, address: str, gateway_id: str, sink: str, *, call_timeout_s: float = 120.0,
                 heartbeat_s: float = 0.25):
        self.address = address
        self.gateway_id = gateway_id
        self.sink = sink
        self.call_timeout_s = call_timeout_s
        self.heartbeat_s = heartbeat_s
        self.state: ClusterState | None = None
        self.state_time = 0.0  # time.monotonic() of the last state frame
        self.on_failed: Callable[[RequestFailed], None] = lambda m: None
        self.on_prefilled: Callable[[PrefillDone], None] = lambda m: None
        self.on_drain: Callable[[Drain], None] = lambda m: None
        self.status: Callable[[], tuple[int, int, bool]] = lambda: (0, 0, False)  # (open streams, tasks, draining)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, gateway_id.encode())
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        close_on_collect(self, self._ctx, [self._sock])
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        # Written by the loop's tick, read by the heartbeat thread (a tuple and a float: each
        # assignment is atomic, and a heartbeat one tick stale is fine).
        self._last_status: tuple[int, int, bool] = (0, 0, False)
        self._last_tick = time.monotonic()
        self._beats = threading.Event()  # set: the heartbeat thread stops
        self._beat_thread: threading.Thread | None = None

    async def start(self) -> None:
        self._sock.connect(self.address)
        self._send(Hello(self.gateway_id, os.getpid(), self.sink))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv(), name="router-channel"),
                       loop.create_task(self._tick(), name="router-tick")]
        self._last_tick = time.monotonic()
        self._beat_thread = threading.Thread(target=self._heartbeats, name="router-heartbeat", daemon=True)
        self._beat_thread.start()

    async def stop(self) -> None:
        self._beats.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=2.0)  # before the goodbye: no heartbeat revives us after it
        if not self._sock.closed:
            self._send(Goodbye(self.gateway_id))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RouterUnavailableError("the gateway is stopping"))
        if not self._sock.closed:
            self._sock.close(linger=200)  # let the goodbye out
        if not self._ctx.closed:
            self._ctx.term()

    @property
    def connected(self) -> bool:
        """The router's state arrived recently (it pushes it at least every second)."""
        return self.state is not None and time.monotonic() - self.state_time < 3.0

    # -- one-way ----------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._sock.send(encode(msg), flags=zmq.NOBLOCK)

    def first_token(self, request_id: str, t: float) -> None:
        self._send(FirstToken(request_id, t))

    def finish(self, request_id: str, abort: bool, first_token_time: float | None = None,
               completion_tokens: int = 0, first_written_time: float | None = None) -> None:
        """Never blocks; with `abort`, every worker that may still hold the request drops it."""
        self._send(Finish(request_id, abort, first_token_time, time.time(), completion_tokens, first_written_time))

    # -- calls ------------------------------------------------------------------------------------
    async def _call(self, make, timeout_s: float | None = None) -> Reply:
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(make(call_id))
            return await asyncio.wait_for(fut, timeout_s or self.call_timeout_s)
        except asyncio.TimeoutError:
            raise RouterUnavailableError("the router did not answer in time") from None
        finally:
            self._calls.pop(call_id, None)

    async def submit(self, req: GenerateRequest) -> None:
        """Returns once a decode worker holds the request; raises what admission or placement refused."""
        reply = await self._call(lambda c: Submit(c, req))
        if reply.error is not None:
            raise error_from_wire(reply.error)

    async def migrate(self, request_id: str, worker_request_id: str, generated: tuple[int, ...],
                      emitted_chars: int, error: str) -> tuple[str, str | None] | None:
        """None: placed again as `worker_request_id` (its tokens follow); else (finish_reason, error)."""
        reply = await self._call(lambda c: Migrate(c, request_id, worker_request_id, generated, emitted_chars, error))
        return None if reply.end is None else (reply.end.finish_reason, reply.end.error)

    async def query(self, what: str, cursor: int = 0, limit: int = 0) -> bytes:
        reply = await self._call(lambda c: Query(c, what, cursor, limit), timeout_s=10.0)
        if reply.error is not None:
            raise error_from_wire(reply.error)
        return reply.body

    # -- receiving --------------------------------------------------------------------------------
    async def _recv(self) -> None:
        while True:
            try:
                msg = decode_to_gateway(await self._sock.recv())
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM or self._sock.closed:
                    return
                log.exception("router channel receive failed")
                continue
            except Exception:  # noqa: BLE001
                log.exception("dropping a malformed frame from the router")
                continue
            if isinstance(msg, Reply):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, RequestFailed):
                self.on_failed(msg)
            elif isinstance(msg, PrefillDone):
                self.on_prefilled(msg)
            elif isinstance(msg, ClusterState):
                self.state, self.state_time = msg, time.monotonic()
            elif isinstance(msg, Drain):
                self.on_drain(msg)

    async def _tick(self) -> None:
        """The loop's part of the heartbeat: what it reports, and proof the loop runs."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.connected:
                self._send(Hello(self.gateway_id, os.getpid(), self.sink))  # the router restarted or lost us
            self._last_status = self.status()
            self._last_tick = time.monotonic()

    def _heartbeats(self) -> None:
        """The heartbeat thread: its own (blocking) socket, since ZMQ sockets are not thread-safe."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)  # a router that is gone: a few heartbeats wait, the rest are dropped
        sock.connect(self.address)
        try:
            while not self._beats.wait(self.heartbeat_s):
                streams, tasks, draining = self._last_status
                beat = Heartbeat(self.gateway_id, streams, tasks, draining, time.monotonic() - self._last_tick)
                try:
                    sock.send(encode(beat), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close(linger=0)
            ctx.term()
