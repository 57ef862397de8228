"""The channel between the gateway processes and the one router: typed msgspec messages over ZMQ.

Each gateway (one per API-server process) holds a DEALER socket connected to the router's ROUTER
socket; every frame is one of the tagged Structs below, msgpack-encoded (never pickle). Calls carry a
`call_id` that their `Reply` repeats; the rest are one-way. The request itself travels as the core
`GenerateRequest` (msgspec encodes and validates the dataclass). A refused call's error travels as a
`WireError` naming its class by its registered kind (cluster.errors.ERROR_KINDS): `error_to_wire`
and `error_from_wire` are the channel's only mapping, so the gateway raises the class the router did.

    gateway -> router   Hello, Heartbeat, Submit*, FirstToken, Finish, Migrate*, Query*, Goodbye
    router -> gateway   Reply (to *), RequestFailed, PrefillDone, ClusterState, Drain
"""

from __future__ import annotations

import msgspec

import router.errors  # noqa: F401 - registers the router's error kinds (ERROR_KINDS) on both ends
from cluster.errors import ERROR_KINDS, PdserveError
from cluster.wire.messages import GenerateRequest
from cluster.wire.stream_messages import StreamDelta


class _Msg(msgspec.Struct, tag=True, frozen=True):
    pass


# -- gateway -> router ------------------------------------------------------------------------------
class Hello(_Msg):
    """First frame of a gateway, and again whenever the router's state has not arrived for a while."""

    gateway_id: str
    pid: int
    sink: str  # its token sink: requests it submits carry it as reply_to


class Heartbeat(_Msg):
    """Sent from a thread of the gateway process (its own socket), so a busy event loop cannot
    starve it: it says the process lives; `loop_lag_s` says whether its loop does."""

    gateway_id: str
    open_streams: int  # requests whose tokens it is waiting for (as of the loop's last tick)
    tasks: int  # asyncio tasks on its loop (bounded when nothing leaks)
    draining: bool
    loop_lag_s: float = 0.0  # how long ago its event loop last ran its tick


class Submit(_Msg):
    """Admit and place a request; `Reply` once a decode worker holds it, or with the refusal."""

    call_id: int
    request: GenerateRequest


class FirstToken(_Msg):
    """The request's first token reached its gateway (admission counts it as running from now)."""

    request_id: str
    t: float


class Finish(_Msg):
    """The gateway is done with the request; with `abort`, every worker holding it drops it."""

    request_id: str
    abort: bool
    first_token_time: float | None
    finished_time: float
    completion_tokens: int
    # the SSE event carrying the first token was handed to the client's socket (a stream; else None)
    first_written_time: float | None = None


class Migrate(_Msg):
    """A worker failed the request after `generated` tokens (of whose text the client has
    `emitted_chars` characters): the router places it again as `worker_request_id` if the failure
    was a worker's death (Reply.end None), else Reply.end is the delta that ends it."""

    call_id: int
    request_id: str
    worker_request_id: str
    generated: tuple[int, ...]
    emitted_chars: int
    error: str


class Query(_Msg):
    """`what`: "stats" (Reply.body: JSON of step and request records from `cursor`, at most `limit`)
    or "metrics" (Reply.body: the router's Prometheus text)."""

    call_id: int
    what: str
    cursor: int = 0
    limit: int = 0


class Goodbye(_Msg):
    gateway_id: str


# -- router -> gateway ------------------------------------------------------------------------------
class WireError(msgspec.Struct, frozen=True):
    """An error crossing the channel: its class by kind, and what that class carries."""

    kind: str  # a key of ERROR_KINDS, or INTERNAL
    message: str
    param: str | None = None
    retry_after_s: int | None = None


INTERNAL = "internal"  # not one of our error classes (a bug on the far side): a RuntimeError here


def error_to_wire(e: BaseException) -> WireError:
    """The error as it crosses: an error class by its kind (a subclass without one as its nearest
    registered ancestor); anything else as INTERNAL, named by its class."""
    kind = e.kind if isinstance(e, PdserveError) else None
    if kind is None:
        return WireError(INTERNAL, f"{e.__class__.__name__}: {e}")
    return WireError(kind, str(e), e.param, e.retry_after_s)


def error_from_wire(w: WireError) -> Exception:
    """The same class again (error_to_wire's inverse); an INTERNAL or unknown kind is a RuntimeError,
    which the gateway answers as a bug (a 500 that does not quote it)."""
    cls = ERROR_KINDS.get(w.kind)
    if cls is None:
        return RuntimeError(w.message)
    e = cls(w.message)
    e.param, e.retry_after_s = w.param, w.retry_after_s
    return e


class Reply(_Msg):
    """Answer to a call: its result (`body` of a Query, `end` of a Migrate), or the `error` that
    refused it."""

    call_id: int
    error: WireError | None = None
    body: bytes = b""
    end: StreamDelta | None = None


class RequestFailed(_Msg):
    """A worker of the request died or failed it (the gateway reads it like an error delta)."""

    request_id: str
    worker_request_id: str
    error: str


class PrefillDone(_Msg):
    """The prompt of the request's placement `worker_request_id` is computed: `cached_tokens` of it
    came from a prefix cache (its usage's prompt_tokens_details). Sent before the Submit's (or
    Migrate's) Reply for a prompt prefilled on its decode worker; for a prefill worker's, once it
    answers, also when it failed (cached_tokens as far as it got): the gateway's reply may wait for it,
    and the worker's last token may have reached the gateway first."""

    request_id: str
    worker_request_id: str
    cached_tokens: int


class ClusterState(_Msg):
    """What every gateway answers /health and /ready from, pushed on change and periodically."""

    ready: bool  # the router polled every worker once and a decode worker is healthy
    healthy_decode: int
    healthy_prefill: int
    kv_capacity_tokens: int  # largest healthy decode worker's KV cache, in tokens
    gateways_up: int
    gateways_expected: int
    draining: bool
    workers_gone: tuple[str, ...] = ()  # dead past their restart limit: the cluster serves without them


class Drain(_Msg):
    """SIGTERM reached the launcher: refuse new requests, finish what runs for up to `timeout_s`."""

    timeout_s: float


ToRouter = Hello | Heartbeat | Submit | FirstToken | Finish | Migrate | Query | Goodbye
ToGateway = Reply | RequestFailed | PrefillDone | ClusterState | Drain

encode = msgspec.msgpack.Encoder().encode
decode_to_router = msgspec.msgpack.Decoder(ToRouter).decode
decode_to_gateway = msgspec.msgpack.Decoder(ToGateway).decode
