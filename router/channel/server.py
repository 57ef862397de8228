"""RouterServer: the one Router, serving every gateway process over its typed channel.

Runs on the launcher's asyncio loop (the Ray driver: the router calls the workers' actors). It owns:
- a ZMQ ROUTER socket the gateways' DEALERs connect to (router/channel/messages.py): submit, first
  token, finish, migrate, stats and metrics queries (a refusal goes back as its error's kind,
  `error_to_wire`); it pushes each gateway the failures of its own requests, the cluster's state
  (what /health and /ready answer from) and the drain on SIGTERM;
- a PULL socket the decode workers send their step records to (`stats_sink`): /stats and the
  step-level metrics, recorded once per step however many gateways there are; it takes frames
  carrying a MAC under the cluster's secret only (cluster/wire/frame_auth.py);
- each finished request's /stats record and phase metrics (router/stats/request_records.py: once its
  prefill worker's answer is in, which the gateway's Finish can beat);
- gateway liveness: a gateway that says goodbye or stops sending heartbeats (its process died) has
  every request it held aborted on the workers, so its clients' KV blocks come back. Heartbeats come
  from a thread of the gateway (router/channel/client.py), so a loop busy with one request for
  seconds does not count as dead; a loop that has not ticked for `gateway_loop_timeout_s` (wedged)
  does.

Admission and placement therefore stay exactly as consistent as with one gateway: one
AdmissionController, one set of worker views, whatever the number of API-server processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from cluster.errors import InvalidRequestError
from cluster.wire.frame_auth import STATS_SINK, FrameVerifier
from cluster.wire.socket_bounds import MAX_INTERNAL_FRAME, MAX_STATS_FRAME, bound, close_on_collect
from cluster.wire.stream_messages import StreamDelta, decode_step_records
from router.channel.messages import (ClusterState, Drain, FirstToken, Finish, Goodbye, Heartbeat, Hello, Migrate,
                                     PrefillDone, Query, Reply, RequestFailed, Submit, decode_to_router, encode,
                                     error_to_wire)
from router.stats.metrics import RouterMetrics
from router.streams.receive_loop import received, verified
from router.router import PlacedRequest, Router
from router.stats.request_records import RequestRecords
from router.stats.step_stats import StepStats, TTFTPoints

log = logging.getLogger(__name__)


@dataclass
class GatewayInfo:
    gateway_id: str
    identity: bytes
    pid: int
    sink: str
    last_seen: float
    open_streams: int = 0
    tasks: int = 0
    draining: bool = False
    up: bool = True
    loop_lag_s: float = 0.0  # how long its event loop had not ticked, at its last heartbeat


class RouterServer:
    def __init__(self, router_address: str, stats_host: str, metrics: RouterMetrics, *,
                 gateways_expected: int = 1, block_size: int = 16, gateway_timeout_s: float = 5.0,
                 gateway_loop_timeout_s: float = 120.0, state_interval_s: float = 0.25, secret: bytes = b""):
        """secret: the cluster's (cluster/wire/frame_auth.py): the stats sink takes frames carrying its MAC only."""
        # Both sockets are bound at construction (before any loop runs): their addresses go to the
        # gateway processes and the decode workers when those are started.
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(router_address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_INTERNAL_FRAME)
        # Bounded before any MAC is checked (cluster/wire/socket_bounds.py).
        self._stats = bound(self._ctx.socket(zmq.PULL), MAX_STATS_FRAME)
        self._stats.setsockopt(zmq.LINGER, 0)
        close_on_collect(self, self._ctx, [self._sock, self._stats])
        port = self._stats.bind_to_random_port(f"tcp://{stats_host}")
        self.stats_sink = f"tcp://{stats_host}:{port}"
        self._stats_verifier = FrameVerifier(secret, STATS_SINK)
        self.metrics = metrics
        self.step_stats = StepStats()
        self.records = RequestRecords(self.step_stats, metrics)
        self.gateways_expected = gateways_expected
        self.block_size = block_size
        self.gateway_timeout_s = gateway_timeout_s
        self.gateway_loop_timeout_s = gateway_loop_timeout_s
        self.state_interval_s = state_interval_s
        self.gateways: dict[str, GatewayInfo] = {}
        self.router: Router | None = None
        self.draining = False
        self._submitting: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._last_state: ClusterState | None = None

    def attach(self, router: Router) -> None:
        self.router = router
        router.notify = self._notify
        router.prefilled = self._prefilled

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._serve(), name="router-server"),
                       loop.create_task(self._collect_steps(), name="router-steps")]
        await self.router.start()
        self._loops.append(loop.create_task(self._housekeeping(), name="router-housekeeping"))

    @property
    def gateways_up(self) -> int:
        return sum(g.up for g in self.gateways.values())

    @property
    def ready(self) -> bool:
        return self.router is not None and self.router.ready and self.gateways_up >= self.gateways_expected

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM: new requests are refused from now; every gateway drains its own."""
        self.draining = True
        self.router.draining = True
        self._broadcast(Drain(timeout_s))
        self._push_state(force=True)

    async def stop(self) -> None:
        for t in self._loops:
            t.cancel()
        for t in list(self._submitting.values()):
            t.cancel()
        if self.router is not None:
            await self.router.stop()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
        self.records.flush()
        self.close()

    def close(self) -> None:
        for s in (self._sock, self._stats):
            if not s.closed:
                s.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()

    # -- sending ----------------------------------------------------------------------------------
    def _send(self, identity: bytes, msg) -> None:
        # NOTE: a ROUTER socket never blocks on send (a gone peer's frames are dropped).
        self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)

    def _broadcast(self, msg) -> None:
        for g in self.gateways.values():
            if g.up:
                self._send(g.identity, msg)

    def _gateway_of(self, rs: PlacedRequest) -> GatewayInfo | None:
        sink = rs.origin.reply_to
        for g in self.gateways.values():
            if g.sink == sink:
                return g
        return None

    def _notify(self, rs: PlacedRequest, error: str) -> None:
        g = self._gateway_of(rs)
        if g is not None and g.up:
            self._send(g.identity, RequestFailed(rs.request_id, rs.worker_request_id, error))

    def _prefilled(self, rs: PlacedRequest) -> None:
        g = self._gateway_of(rs)
        if g is not None and g.up:
            self._send(g.identity, PrefillDone(rs.request_id, rs.worker_request_id, rs.cached_tokens))
        self.records.answered(rs)  # a request that finished first is recorded now, with its timeline

    def cluster_state(self) -> ClusterState:
        r = self.router
        decode = [v for v in r.decode_views() if v.healthy]
        return ClusterState(
            ready=r.ready, healthy_decode=len(decode), healthy_prefill=sum(v.healthy for v in r.prefill_views()),
            kv_capacity_tokens=max((v.total_blocks for v in decode), default=0) * self.block_size,
            gateways_up=self.gateways_up, gateways_expected=self.gateways_expected, draining=self.draining,
            workers_gone=tuple(sorted(r.health.gone)))

    def _push_state(self, force: bool = False) -> None:
        state = self.cluster_state()
        if force or state != self._last_state:
            self._last_state = state
            self._broadcast(state)

    # -- receiving --------------------------------------------------------------------------------
    async def _serve(self) -> None:
        async for identity, msg in received(self._sock, self._read_gateway_frame, "frame from a gateway"):
            try:
                self._handle(identity, msg)
            except Exception:  # noqa: BLE001
                log.exception("handling %s failed", type(msg).__name__)

    async def _read_gateway_frame(self):
        identity, frame = await self._sock.recv_multipart()
        return identity, decode_to_router(frame)

    def _handle(self, identity: bytes, msg) -> None:
        now = time.monotonic()
        r = self.router
        if isinstance(msg, Submit):
            self._submit(identity, msg)
        elif isinstance(msg, FirstToken):
            r.first_token(msg.request_id, msg.t)
        elif isinstance(msg, Finish):
            task = self._submitting.pop(msg.request_id, None)
            if task is not None:
                task.cancel()  # the client left while the request was being placed: undo the placement
            rs = r.inflight.get(msg.request_id)
            r.finish(msg.request_id, abort=msg.abort, generated=msg.completion_tokens)  # first: nothing below may leak it
            if rs is not None and not msg.abort:
                placed = rs.placed_time or rs.origin.arrival_time
                points = TTFTPoints(rs.origin.arrival_time, rs.admitted_time or placed,
                                    None if rs.local_prefill else rs.dispatched_time, placed, msg.first_token_time,
                                    rs.origin.received_time, msg.first_written_time)
                self.records.finished(rs, points, msg.finished_time, msg.completion_tokens)
        elif isinstance(msg, Migrate):
            self._spawn(self._migrate(identity, msg))
        elif isinstance(msg, Query):
            if msg.what == "stats":
                body = self.step_stats.since(msg.cursor, msg.limit)
            elif msg.what == "metrics":
                self._observe_gauges()
                body = self.metrics.render()
            else:
                refused = InvalidRequestError(f"unknown query {msg.what!r}")
                self._send(identity, Reply(msg.call_id, error_to_wire(refused)))
                return
            self._send(identity, Reply(msg.call_id, body=body))
        elif isinstance(msg, Hello):
            g = self.gateways.get(msg.gateway_id)
            if g is None or g.identity != identity or g.pid != msg.pid:
                self.gateways[msg.gateway_id] = GatewayInfo(msg.gateway_id, identity, msg.pid, msg.sink, now)
                log.info("gateway %s (pid %d) connected, tokens at %s", msg.gateway_id, msg.pid, msg.sink)
            else:
                g.last_seen, g.up = now, True
            self._send(identity, self.cluster_state())
        elif isinstance(msg, Heartbeat):
            g = self.gateways.get(msg.gateway_id)
            if g is not None:
                g.last_seen, g.open_streams, g.tasks, g.draining = now, msg.open_streams, msg.tasks, msg.draining
                g.loop_lag_s = msg.loop_lag_s
                if not g.up and msg.loop_lag_s < self.gateway_loop_timeout_s:
                    g.up = True
                    # To its loop's socket (`identity` is the heartbeat thread's, which reads nothing).
                    self._send(g.identity, self.cluster_state())
        elif isinstance(msg, Goodbye):
            g = self.gateways.get(msg.gateway_id)
            if g is not None:
                self._gateway_gone(g, "said goodbye")

    def _submit(self, identity: bytes, msg: Submit) -> None:
        rid = msg.request.request_id

        async def run():
            try:
                await self.router.submit(msg.request)
                reply = Reply(msg.call_id)
            except asyncio.CancelledError:  # the client went away (nobody reads this reply)
                reply = Reply(msg.call_id, error_to_wire(RuntimeError("cancelled: the client went away")))
            except Exception as e:  # noqa: BLE001 - every refusal goes back as its error's kind
                reply = Reply(msg.call_id, error_to_wire(e))
            finally:
                self._submitting.pop(rid, None)
            self._send(identity, reply)
        self._submitting[rid] = self._spawn(run())

    async def _migrate(self, identity: bytes, msg: Migrate) -> None:
        try:
            end = await self.router.migrate(msg.request_id, msg.worker_request_id, msg.generated,
                                            msg.emitted_chars, msg.error)
        except Exception as e:  # noqa: BLE001
            end = ("error", f"{msg.error}; migration failed: {e}")
        delta = None if end is None else StreamDelta(msg.worker_request_id, (), "", end[0], end[1])
        self._send(identity, Reply(msg.call_id, end=delta))

    async def _collect_steps(self) -> None:
        async for batch in received(self._stats, self._read_step_records, "step record batch"):
            for rec in batch.records:
                self.step_stats.record_step(rec)
                self.metrics.observe_step(rec)

    async def _read_step_records(self):
        payload = verified(self._stats_verifier, await self._stats.recv_multipart(copy=False), "step record frame",
                           lambda: self.metrics.frame_rejected("stats_sink"))
        return None if payload is None else decode_step_records(payload)

    async def _housekeeping(self) -> None:
        """Pushes the cluster state on change (and every second regardless: a gateway that missed
        one catches up), and retires gateways whose heartbeats stopped."""
        last_full = 0.0
        while True:
            await asyncio.sleep(self.state_interval_s)
            now = time.monotonic()
            for g in list(self.gateways.values()):
                if g.up and now - g.last_seen > self.gateway_timeout_s:
                    self._gateway_gone(g, f"sent nothing for {self.gateway_timeout_s:g}s")
                elif g.up and g.loop_lag_s > self.gateway_loop_timeout_s:
                    self._gateway_gone(g, f"has an event loop stuck for {g.loop_lag_s:.0f}s")
            self._push_state(force=now - last_full > 1.0)
            if now - last_full > 1.0:
                last_full = now

    def _gateway_gone(self, g: GatewayInfo, why: str) -> None:
        """Its clients are gone with it: abort every request it held (their KV blocks come back)."""
        g.up = False
        held = [rs.request_id for rs in self.router.inflight.values() if rs.origin.reply_to == g.sink]
        for rid in held:
            task = self._submitting.pop(rid, None)
            if task is not None:
                task.cancel()
            self.router.finish(rid, abort=True)
        log.warning("gateway %s (pid %d) %s; aborted its %d requests", g.gateway_id, g.pid, why, len(held))

    def _observe_gauges(self) -> None:
        self.metrics.waiting.set(self.router.admission.num_queued)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
