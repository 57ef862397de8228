"""The step channel of a tensor-parallel worker: rank 0 pushes every step message (step_messages.py) to
each follower, in order, over ZMQ on an ipc:// path (a worker's ranks share one node: its
placement-group bundle) in a directory only this user can enter (cluster/wire/socket_bounds.py): no other
local user can connect, so no forged Stop ends a rank. Rank 0 connects only to such a path
(`check_private_endpoint`), whatever the group's store says.

Each follower binds a PULL socket and publishes its endpoint in the group's store; rank 0 connects one
PUSH socket per follower. ZMQ keeps one socket's order, which is the order of the passes. Sending never
blocks rank 0 (a message for a follower that stopped reading is queued up to the high-water mark, then
the send fails): a dead follower is found by the watchdog (watchdog.py), never by waiting here.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from cluster.distributed.step_messages import DECODER, ENCODER, StepMessage
from cluster.wire.socket_bounds import MAX_INTERNAL_FRAME, bound, check_private_endpoint, private_endpoint

log = logging.getLogger(__name__)

_MAX_QUEUED = 1 << 14


class StepPublisher:
    """Rank 0's side: one PUSH socket per follower."""

    def __init__(self, endpoints: list[str]):
        ctx = zmq.Context.instance()
        self._socks = []
        for ep in endpoints:
            s = bound(ctx.socket(zmq.PUSH), MAX_INTERNAL_FRAME, _MAX_QUEUED)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(check_private_endpoint(ep))
            self._socks.append(s)
        self.sent = 0

    def publish(self, msg: StepMessage) -> None:
        """Queues the message for every follower; never blocks. Raises ConnectionError when a follower
        has stopped reading (its queue is full)."""
        raw = ENCODER.encode(msg)
        for s in self._socks:
            try:
                s.send(raw, zmq.NOBLOCK)
            except zmq.Again:
                raise ConnectionError(f"{_MAX_QUEUED} step messages queued for a follower that does not read them") from None
        self.sent += 1

    def close(self) -> None:
        for s in self._socks:
            s.close(linger=0)
        self._socks = []


class StepSubscriber:
    """A follower's side: the PULL socket rank 0 pushes to, on a private ipc:// path."""

    def __init__(self):
        self._sock = bound(zmq.Context.instance().socket(zmq.PULL), MAX_INTERNAL_FRAME, _MAX_QUEUED)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = private_endpoint("tp-step")
        self._sock.bind(self.endpoint)
        self.dropped = 0

    def recv(self, timeout_s: float) -> StepMessage | None:
        """The next message, or None after timeout_s without one."""
        if not self._sock.poll(max(0, int(timeout_s * 1000))):
            return None
        raw = self._sock.recv()
        try:
            return DECODER.decode(raw)  # data only: nothing on this socket is unpickled
        except msgspec.DecodeError:
            self.dropped += 1
            log.error("dropped a step frame that is not a step message (%d bytes)", len(raw))
            raise

    def close(self) -> None:
        self._sock.close(linger=0)
