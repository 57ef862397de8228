"""The receive loop of the router side's asyncio ZMQ sockets, in one place: the router channel (frames
from gateways), the router's step-record sink and a gateway's token stream all read it this way.

`received(sock, read, what)` yields what `read()` returns, frame after frame, until the socket is
closed (or its context terminated). A frame `read` returns None for (dropped: a bad MAC) or raises on
(malformed) is logged and skipped: one bad frame never stops the stream of everyone else. A ZMQ error
on an open socket is logged and the loop goes on; a cancel propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import zmq

from cluster.wire.frame_auth import FrameVerifier
from cluster.wire.socket_bounds import RateLimitedLog

log = logging.getLogger(__name__)
# A flood of forgeries costs one log line per interval, not one per frame (each is still counted).
_rejections = RateLimitedLog(log)

T = TypeVar("T")


async def received(sock: zmq.asyncio.Socket, read: Callable[[], Awaitable[T | None]], what: str) -> AsyncIterator[T]:
    """What `read()` makes of each frame of `sock` (`what` names a frame in the log)."""
    while True:
        try:
            msg = await read()
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if e.errno == zmq.ETERM or sock.closed:
                return
            log.exception("receiving a %s failed", what)
            continue
        except Exception:  # noqa: BLE001 - a malformed frame must not stop the stream
            log.exception("dropping a malformed %s", what)
            continue
        if msg is not None:
            yield msg


def verified(verifier: FrameVerifier, parts, what: str, on_rejected: Callable[[], None]) -> bytes | None:
    """The payload of a MAC'd frame, or None (logged at a limited rate, `on_rejected()` called) for one that is not from a
    holder of the cluster's secret (or a replay): such a frame is never decoded."""
    payload = verifier.open(parts)
    if payload is None:
        _rejections.warn("dropped a %s without a valid MAC (%d so far)", what, verifier.rejected)
        on_rejected()
    return payload
