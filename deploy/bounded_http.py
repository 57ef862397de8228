"""BoundedHttpToolsProtocol: uvicorn's httptools protocol with the limits it lacks.

uvicorn bounds connections (`limit_concurrency`, 503 past it) and idle keep-alive connections
(`timeout_keep_alive`), but with the httptools parser nothing bounds a request's head: a client may
send headers (or a URL) without end, buffered in memory, or trickle them a byte a minute and hold a
connection slot forever (slowloris). Here a request line and headers over MAX_HEAD_BYTES get 431 and
the connection closes, and a head not complete HEAD_TIMEOUT_S after the connection opened (or after
its previous request) gets 408 and closes. The body is bounded by the app (middleware.BodySizeLimit).

Every answer given here, before the request reaches the app, is in OpenAI's error shape like the
app's own (`{"error": {"message", "type", "param", "code"}}`, router/openai/errors.py): the 431 and
408 above, the parser's 400 for a malformed request, and uvicorn's 503 past `limit_concurrency`
(uvicorn answers it with a plain-text ASGI app of its own: `_start_asgi_task` swaps it for
`service_unavailable` below).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.openai.protocol_responses import ErrorResponse

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0


class _HeadTooLarge(Exception):
    pass


def error_body(message: str, type: str, code: str) -> bytes:
    """OpenAI's error body, as the app's error answers have it."""
    return ErrorResponse.of(message, type, None, code).model_dump_json().encode()


def _json_response(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


_UNAVAILABLE = error_body("the server has too many connections open; retry later", "service_unavailable",
                          "too_many_connections")


async def service_unavailable(scope, receive, send) -> None:
    """uvicorn's answer past `limit_concurrency`, in OpenAI's shape (uvicorn's own is plain text)."""
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_UNAVAILABLE)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": _UNAVAILABLE, "more_body": False})


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
        # The parser's error path (uvicorn's is plain text): for a head over the limit, answer what it was.
        if self._head_too_large:
            reply = _json_response(b"431 Request Header Fields Too Large", error_body(
                f"the request line and headers exceed {self.max_head_bytes} bytes", "invalid_request_error",
                "request_header_fields_too_large"))
        else:
            reply = _json_response(b"400 Bad Request", error_body(msg, "invalid_request_error", "invalid_http_request"))
        self.transport.write(reply)
        self.transport.close()

    def _start_asgi_task(self, cycle, app) -> None:
        # Past limit_concurrency, uvicorn picks its own plain-text 503 app (httptools_impl's global).
        if app is httptools_impl.service_unavailable:
            app = service_unavailable
        super()._start_asgi_task(cycle, app)

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
            self.transport.write(_json_response(b"408 Request Timeout", error_body(
                f"the request's head did not arrive within {self.head_timeout_s:g} s", "invalid_request_error",
                "request_timeout")))
            self.transport.close()
