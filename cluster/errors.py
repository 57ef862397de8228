"""Errors that reach a user: each one prints as a single line, never a traceback.

Every error class says, once, how it reaches a client: its HTTP status, OpenAI error type and code
and Retry-After are class attributes here, read by the gateway's one mapping
(router/openai/errors.py::api_error); its `kind` names it on the router's channel, which encodes an
error by that name and raises the same class again on the far side (router/channel/messages.py)
through `ERROR_KINDS`. A class that sets `kind` registers itself (and can be built from its message
alone: the channel sets `param` and `retry_after_s` after); a subclass that does not (e.g.
router.errors.CapacityShortError) crosses and maps as its nearest registered ancestor.
"""

from __future__ import annotations

from typing import ClassVar

# kind -> class, filled by PdserveError.__init_subclass__ (router/errors.py adds the router's own).
ERROR_KINDS: dict[str, type[PdserveError]] = {}


class PdserveError(Exception):
    """Base of the errors pdserve raises on purpose: bad input or configuration, no room, shutting
    down. The base class and subclasses without a `kind` (ModelLoadError, a configuration error) are
    not meant for an HTTP client: they cross the channel as "internal" and answer a 500 naming their
    class."""

    kind: ClassVar[str | None] = None  # its name on the router's channel (and in ERROR_KINDS)
    http_status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "internal_error"
    openai_code: ClassVar[str | None] = None
    close_connection: ClassVar[bool] = False  # answered with `Connection: close` (the server is going away)
    # Raised by a worker about one request it cannot take now (not a fault of the worker): the router
    # answers the request with it and does not count it against the worker's health.
    worker_refusal: ClassVar[bool] = False
    # Per instance where a subclass says so (class defaults otherwise); both travel on the channel.
    param: str | None = None  # the request field at fault
    retry_after_s: int | None = None  # the Retry-After header, in seconds (None: no header)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return
        prev = ERROR_KINDS.get(kind)
        if prev is not None and (prev.__module__, prev.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"error kind {kind!r} is taken by {prev.__module__}.{prev.__qualname__}")
        ERROR_KINDS[kind] = cls


class ModelLoadError(PdserveError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class InvalidRequestError(PdserveError):
    """A request or its sampling parameters are invalid (HTTP 400)."""

    kind = "invalid"
    http_status = 400
    openai_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CapacityError(PdserveError):
    """No room for the request right now (HTTP 429): queue or KV capacity is full."""

    kind = "capacity"
    http_status = 429
    openai_type = "rate_limit_error"
    openai_code = "rate_limit_exceeded"
    retry_after_s = 1
    worker_refusal = True  # (e.g. a worker's grammar compiles are all taken)
