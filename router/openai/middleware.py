"""The gateway's ASGI middleware: the request's receipt stamp, the API key and the request body's
size, all before the app parses anything.

`ReceivedStamp` is the outermost: it stamps (time.time()) when the app got the request, into the
ASGI scope under RECEIVED, so the server's TTFT (/stats: `received` -> `intake` -> ...) counts the
routing, the body's parse and validation and the tokenization that come before the gateway submits it.

`APIKeyAuth` is the outermost of the checks: an unauthenticated client learns nothing from validation (not even
that its JSON is invalid) and never costs a parse or a buffered body. `BodySizeLimit` refuses a body
over the limit by its Content-Length, or while it arrives when there is none.
"""

from __future__ import annotations

import hmac
import time

from router.openai.errors import body_too_large, error_response, invalid_api_key

# Paths behind the API key; /health, /ready, /version and the schema stay open for probes. /metrics
# is keyed too: it names the model, the load and the workers, and renders on the gateway's and the
# router's loops (Prometheus sends the key: `authorization: {type: Bearer, credentials_file: ...}`).
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize", "/stats", "/metrics")


RECEIVED = "pdserve.received"  # the ASGI scope's key of ReceivedStamp's stamp


class ReceivedStamp:
    """ASGI middleware, the outermost: `scope[RECEIVED]` = time.time() when the app got an HTTP
    request (uvicorn calls it once the request's headers are parsed)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[RECEIVED] = time.time()
        return await self.app(scope, receive, send)


def check_api_key(authorization: str, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), key.encode())


class APIKeyAuth:
    """ASGI middleware: every request to KEYED_PATHS without the API key gets 401 before anything reads its
    body, so an unauthenticated client learns nothing from validation (not even that its JSON is
    invalid) and never costs a parse. The outermost middleware: before the body-size limit too."""

    def __init__(self, app, key: str | None, on_refused=lambda: None):
        self.app = app
        self.key = key
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if self.key and scope["type"] == "http" and scope["path"].startswith(KEYED_PATHS):
            auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not check_api_key(auth.decode("latin-1"), self.key):
                self.on_refused()
                resp = error_response(invalid_api_key())
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: refuses request bodies above `max_bytes` with a 413 before the app parses them."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        resp = error_response(body_too_large(self.max_bytes))
        await resp(scope, receive, send)
