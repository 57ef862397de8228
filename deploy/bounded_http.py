"""BoundedHttpToolsProtocol: uvicorn's httptools protocol with the limits it lacks.

uvicorn bounds connections (`limit_concurrency`, 503 past it) and idle keep-alive connections
(`timeout_keep_alive`), but with the httptools parser nothing bounds a request's head: a client may
send headers (or a URL) without end, buffered in memory, or trickle them a byte a minute and hold a
connection slot forever (slowloris). Here a request line and headers over MAX_HEAD_BYTES get 431 and
the connection closes, and a head not complete HEAD_TIMEOUT_S after the connection opened (or after
its previous request) gets 408 and closes. The body is bounded by the app (middleware.BodySizeLimit).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0


class _HeadTooLarge(Exception):
    pass


def _plain_response(status: bytes, msg: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
            + str(len(msg)).encode() + b"\r\nconnection: close\r\n\r\n" + msg)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._head_timer is None:  # the next request of a keep-alive connection
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        # The parser's error path: for a head over the limit, answer what it was.
        if self._head_too_large:
            self.transport.write(_plain_response(b"431 Request Header Fields Too Large",
                                                 b"the request line and headers exceed %d bytes" % self.max_head_bytes))
            self.transport.close()
            return
        super().send_400_response(msg)

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLarge()  # httptools stops parsing and raises a parser error: send_400_response

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.write(_plain_response(b"408 Request Timeout", b"the request's head did not arrive in time"))
            self.transport.close()
