"""What bounds one API-server process against one client's costly request, without a cluster:

- heartbeats come from a thread, so a gateway whose event loop is busy for longer than the router's
  heartbeat timeout stays up (its requests are not aborted); a loop wedged past the loop timeout is
  retired;
- grammar checks: a bounded number in progress (then 429), and a deadline (then 400);
- the HTTP server's request head: 431 past its size, 408 when it trickles in past its deadline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from cluster.errors import InvalidRequestError
from cluster.structured import StructuredOutput
from deploy.bounded_http import BoundedHttpToolsProtocol
from router.channel.client import RouterClient
from router.channel.server import RouterServer
from router.errors import OverloadedError
from router.stats.metrics import GatewayMetrics, RouterMetrics
from router.openai import gateway as gateway_module
from router.openai.gateway import GRAMMAR_CHECK_THREADS, GRAMMAR_CHECKS_MAX, Gateway
from router.openai.gateway_config import GatewayConfig
from router.streams.token_stream import TokenStreamReceiver


class _NoWorkers:
    """What RouterServer reads of its Router, with no worker (gateway liveness is the subject)."""

    ready, inflight, health = True, {}, SimpleNamespace(gone=set())

    def decode_views(self):
        return []

    def prefill_views(self):
        return []

    def finish(self, request_id, abort=False, generated=0):
        pass

    async def start(self):
        pass

    async def stop(self):
        pass


def test_a_busy_loop_keeps_its_heartbeats_and_a_wedged_one_is_retired():
    async def main():
        tmp = tempfile.mkdtemp()
        rs = RouterServer(f"ipc://{tmp}/router", "127.0.0.1", RouterMetrics("m"), gateway_timeout_s=1.0,
                          gateway_loop_timeout_s=4.0, state_interval_s=0.05)
        rs.attach(_NoWorkers())
        await rs.start()
        # The gateway's loop runs on a thread of its own, so that it can be blocked here.
        gw_loop = asyncio.new_event_loop()
        threading.Thread(target=gw_loop.run_forever, daemon=True).start()
        client = RouterClient(rs.address, "api-0", "tcp://127.0.0.1:1", heartbeat_s=0.05)
        asyncio.run_coroutine_threadsafe(client.start(), gw_loop).result(10)
        try:
            for _ in range(200):
                if "api-0" in rs.gateways:
                    break
                await asyncio.sleep(0.02)
            g = rs.gateways["api-0"]
            gw_loop.call_soon_threadsafe(time.sleep, 2.5)  # busy 2.5x the heartbeat timeout (one huge request)
            gaps, t_end = [], time.monotonic() + 3.0
            while time.monotonic() < t_end:
                gaps.append(time.monotonic() - g.last_seen)
                await asyncio.sleep(0.05)
            assert g.up and max(gaps) < 0.8, max(gaps)  # heartbeats never paused; nothing was aborted

            gw_loop.call_soon_threadsafe(time.sleep, 6.0)  # wedged past the loop timeout (4 s)
            for _ in range(200):
                if not g.up:
                    break
                await asyncio.sleep(0.05)
            assert not g.up and g.loop_lag_s > 4.0
            for _ in range(200):  # the loop ticks again: back up
                if g.up:
                    break
                await asyncio.sleep(0.05)
            assert g.up
        finally:
            asyncio.run_coroutine_threadsafe(client.stop(), gw_loop).result(10)
            gw_loop.call_soon_threadsafe(gw_loop.stop)
            await rs.stop()

    asyncio.run(main())


class _SlowGrammars:
    """A grammar engine whose checks wait for `gate`."""

    def __init__(self):
        self.gate = threading.Event()

    def check(self, so):
        assert self.gate.wait(30)

    def close(self):
        pass


def test_grammar_checks_are_bounded_in_number_and_time(monkeypatch):
    tokens = TokenStreamReceiver()
    gw = Gateway(GatewayConfig("m", 64), None, RouterClient("inproc://none", "probe", tokens.address), tokens,
                 GatewayMetrics("m"))
    slow = gw.grammars = _SlowGrammars()
    monkeypatch.setattr(gateway_module, "GRAMMAR_CHECK_TIMEOUT_S", 0.5)

    async def main():
        so = StructuredOutput.regex("a+")
        waiting = [asyncio.ensure_future(gw.check_constraint(so, "guided_regex")) for _ in range(GRAMMAR_CHECKS_MAX)]
        await asyncio.sleep(0.05)
        with pytest.raises(OverloadedError):  # a 429: the queue is full
            await gw.check_constraint(so, "guided_regex")
        for e in await asyncio.gather(*waiting, return_exceptions=True):  # a 400 naming the field, each
            assert isinstance(e, InvalidRequestError) and e.param == "guided_regex" and "within 0.5s" in str(e)
        await asyncio.sleep(0.1)
        # The waiting ones were dropped; the running ones (still parsing) hold their slots ...
        assert gw._checks == GRAMMAR_CHECK_THREADS
        slow.gate.set()
        monkeypatch.setattr(gateway_module, "GRAMMAR_CHECK_TIMEOUT_S", 60.0)
        for _ in range(300):
            if gw._checks == 0:
                break
            await asyncio.sleep(0.02)
        await gw.check_constraint(so, "guided_regex")  # ... until their threads are done
        assert gw._checks == 0

    try:
        asyncio.run(main())
    finally:
        slow.gate.set()
        tokens.close()


class _QuickHeadServer(BoundedHttpToolsProtocol):
    head_timeout_s = 0.5


async def _ok_app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _start_server(protocol, **config):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_ok_app, http=protocol, lifespan="off", log_level="critical", **config))
    failed = []

    def run():
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, failed
    return server, thread, sock.getsockname()[1]


def _openai_error(reply: bytes, status: int, code: str) -> dict:
    """The reply's status is `status` and its body OpenAI's error shape with `code`."""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), head
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"], err
    return err


def _exchange(port: int, *parts: bytes, pause: float = 0.0) -> bytes:
    """What the server answers to `parts`: up to its close (an error closes), or a 200's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for p in parts:
            s.sendall(p)
            time.sleep(pause)
        reply = b""
        while not reply.startswith(b"HTTP/1.1 200"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        return reply


def test_request_heads_are_bounded_in_size_and_time():
    server, thread, port = _start_server(_QuickHeadServer)
    try:
        def exchange(*parts: bytes, pause: float = 0.0) -> bytes:
            return _exchange(port, *parts, pause=pause)

        assert exchange(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
        big = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(80))
        _openai_error(exchange(b"GET / HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n"), 431,
                      "request_header_fields_too_large")
        _openai_error(exchange(b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"), 431, "request_header_fields_too_large")
        t0 = time.monotonic()  # slowloris: a header a while, never the end of the head
        _openai_error(exchange(b"GET / HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: b\r\n", pause=0.3), 408,
                      "request_timeout")
        assert time.monotonic() - t0 < 5
        _openai_error(exchange(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"), 400, "invalid_http_request")
        assert exchange(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")  # serving on
    finally:
        server.should_exit = True
        thread.join(10)


def test_past_the_connection_limit_is_503_in_openais_shape():
    """uvicorn's own answer past limit_concurrency is plain text; ours is OpenAI's error body."""
    server, thread, port = _start_server(BoundedHttpToolsProtocol, limit_concurrency=2)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10):  # holds one of the two
            time.sleep(0.1)
            reply = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        err = _openai_error(reply, 503, "too_many_connections")
        assert err["type"] == "service_unavailable" and b"retry-after: 1" in reply.lower()
        time.sleep(0.1)
        assert _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(10)
