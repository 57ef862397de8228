"""The step channel of a tensor-parallel worker: rank 0 pushes every step message (step_messages.py) to
each follower, in order, over ZMQ on the node's loopback (a worker's ranks share one node: its
placement-group bundle).

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

log = logging.getLogger(__name__)

_MAX_QUEUED = 1 << 14


class StepPublisher:
    """Rank 0's side: one PUSH socket per follower."""

    def __init__(self, endpoints: list[str]):
        ctx = zmq.Context.instance()
        self._socks = []
        for ep in endpoints:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, _MAX_QUEUED)
            s.connect(ep)
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
    """A follower's side: the PULL socket rank 0 pushes to, bound on `host`."""

    def __init__(self, host: str = "127.0.0.1"):
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, _MAX_QUEUED)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
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
