"""SSEConnection: the TTFT load client's HTTP/1.1 connection. One streamed POST at a time on one
keep-alive connection; the response parsed by httptools (the C parser uvicorn serves pdserve with), on
whatever event loop runs it (benchmarks.ttft_cases runs uvloop's).

Why not httpx: a client process reads 16 users' streams of 256 tokens, one SSE event per token, and
each event arrives on its own. httpx (httpcore, h11) costs ~150 us more of the client's CPU per event:
against the demo model's server on the 2-core CPU host, 22.5 ms of CPU per 128-token request, this
connection 3.8 ms (benchmarks.ttft_http's `client_cpu_ms_per_request`, loadtest/results/
ttft_http_clients_cpu.json). At 64 users on the H100 host each httpx client process ran at 85-100 % of a
core (loadtest/results/ttft_h100.md), and a client loop that is late by the events it has not read yet
stamps that lateness into every first token it reads.

Only what the TTFT needs is parsed: the SSE lines up to the event carrying the first token
(loadtest.records.token_chunks' rule); the rest of the body is kept as bytes for one check when it ends
(an error event after the first token still fails the request).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httptools

from loadtest.records import token_chunks

# An error event's own key. JSON escapes the quotes inside strings, so generated text never reads '"error":'.
_ERROR_KEY = b'"error":'


class _Exchange:
    """One request's response as it arrives: status, the SSE lines up to the first token, the rest."""

    def __init__(self) -> None:
        self.status = 0
        self.lines: list[tuple[float, bytes]] = []
        self.pending = b""  # the part of a line not ended yet (before the first token)
        self.first: tuple[float, str] | None = None  # (perf_counter when read, the response's id)
        self.error: str | None = None  # an error event before the first token
        self.rest = bytearray()  # the body after the event carrying the first token (or a non-200 body)
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def body(self, data: bytes, at: float) -> None:
        if self.first is not None or self.error is not None or self.status != 200:
            self.rest += data
            return
        *complete, self.pending = (self.pending + data).split(b"\n")
        self.lines += [(at, line.rstrip(b"\r")) for line in complete
                       if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
        carried, _, err = token_chunks(self.lines)
        if err is not None:
            self.error = err
        elif carried:
            self.first = carried[0][0], json.loads(self.lines[0][1][5:]).get("id", "")
            self.rest += self.pending

    def result(self, t0: float) -> tuple[float, float, str] | str:
        if self.status != 200:
            return f"HTTP {self.status}: {bytes(self.rest[:200])!r}"
        if self.error is not None:
            return f"stream error: {self.error!r}"
        if self.first is None:
            return "no token chunk"
        if _ERROR_KEY in self.rest:
            at = self.rest.index(_ERROR_KEY)
            return f"stream error after the first token: {bytes(self.rest[at:at + 200])!r}"
        return t0, self.first[0], self.first[1]


class _Protocol(asyncio.Protocol):
    """The connection's transport side: feeds httptools, hands the body to the exchange in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.closed = False
        self._at = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._at = time.perf_counter()  # the moment these bytes were read: what the first token is stamped with
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(f"bad HTTP response: {e}")
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._fail(f"connection lost: {exc!r}" if exc else "connection closed by the server")

    def _fail(self, why: str) -> None:
        ex, self.exchange = self.exchange, None
        if ex is not None and not ex.done.done():
            ex.done.set_exception(ConnectionError(why))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.body(body, self._at)

    def on_message_complete(self) -> None:
        ex, self.exchange = self.exchange, None
        if ex is not None and not ex.done.done():
            ex.done.set_result(None)
        if not self.parser.should_keep_alive():
            self.transport.close()


class SSEConnection:
    def __init__(self, url: str, timeout_s: float = 120.0):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s
        self._proto: _Protocol | None = None

    async def connect(self) -> None:
        """Opens the connection now (else the next request does, inside its own timing)."""
        if self._proto is None or self._proto.closed:
            _, self._proto = await asyncio.get_running_loop().create_connection(_Protocol, self.host, self.port)

    def request(self, path: str, body: dict) -> bytes:
        """A POST's bytes, built before its timing starts."""
        data = json.dumps(body, separators=(",", ":")).encode()
        return (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data

    async def stream(self, raw: bytes) -> tuple[float, float, str] | str:
        """Sends one request (`request()`'s bytes), reads its whole response -> (its start, the moment the
        bytes of the event carrying its first token were read: perf_counter each; the response's id), or
        why it failed (the connection is opened again for the next one)."""
        try:
            await self.connect()
        except OSError as e:
            return f"connect failed: {e!r}"
        proto = self._proto
        ex = proto.exchange = _Exchange()
        t0 = time.perf_counter()
        proto.transport.write(raw)
        try:
            await asyncio.wait_for(ex.done, self.timeout_s)
        except (ConnectionError, asyncio.TimeoutError) as e:  # (asyncio's is the builtin from 3.11 on)
            proto.transport.close()  # a half-read response leaves the connection unusable
            return repr(e)
        return ex.result(t0)

    def close(self) -> None:
        if self._proto is not None and not self._proto.closed:
            self._proto.transport.close()
