"""The KV transfers' push channel: typed control messages from prefill workers to a decode worker, ZMQ.

Each decode worker binds one PULL socket (`Inbox`) on the cluster's internal address (or in-process,
`inproc://`, when the transports rendezvous through an in-process store) and publishes its endpoint in
the store. A prefill worker connects one PUSH socket (`Outbox`) per decode peer. ZMQ keeps the order of
one socket's messages, so the decode side sees a pair's messages in the order the prefill sent them:
that order, not a sequence number, is what matches the payload's sends and receives.

Messages are msgspec Structs on msgpack (no pickle), tagged by kind:
  Hello   once per pair: forms the payload channel (and warms it up)
  Begin   a bundle of transfers is claimed and its payload follows (receives go up now)
  Commit  the bundle's first tokens (or per-transfer failure); the decode side reports arrivals
          once the payload has landed too
  Abort   one claimed transfer carries no KV (the prefill failed or was aborted before its forward)
  Broken  the prefill broke the pair (the pair, not a worker, failed); a new Hello re-forms it
Every frame carries a MAC under the cluster's secret (cluster/wire/frame_auth.py); one without it, or that
does not decode as one of them, is dropped and counted. The Inbox also wakes on
`wake()` (an os pipe), so the decode side's other threads hand it work without a socket each.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Union

import msgspec
import zmq

from cluster.wire.frame_auth import KV_CONTROL, FrameSigner, FrameVerifier
from cluster.sampling.logprobs import PrefillLogprobs
from cluster.wire.socket_bounds import MAX_KV_CONTROL_FRAME, RateLimitedLog, bound

log = logging.getLogger(__name__)
_rejections = RateLimitedLog(log)

_MAX_QUEUED = 4096  # messages a socket holds per peer (a PUSH for a slow or dead peer before send fails)


class Hello(msgspec.Struct, tag="h"):
    p: str  # the prefill worker
    layout: dict  # the prefill's PlanSpec (plan.py: KV layout, payload): must equal the decode side's
    events: list[bytes] = []  # same-GPU: IPC handles of the pair's doorbell events
    inc: int = 0  # the prefill's incarnation (control.py: restarts)
    gen: int = 0  # the pair's generation between these two incarnations (a broken pair re-formed)


class Begin(msgspec.Struct, tag="b"):
    p: str
    b: int  # bundle id, unique per prefill worker
    layerwise: bool
    fingerprint: int  # of the plan both sides compute (plan.py)
    items: list[tuple[int, str, int, bytes]]  # (transfer_seq, request_id, num_tokens, src blocks as <i4)


class Commit(msgspec.Struct, tag="c"):
    p: str
    b: int
    tokens: list[int]  # first token per item (-1 where it failed)
    ok: list[bool]
    event: int = -1  # same-GPU: the doorbell event recorded after the payload
    logprobs: list[PrefillLogprobs | None] = []  # per item, when its request asks (else empty)


class Abort(msgspec.Struct, tag="a"):
    p: str
    seq: int
    request_id: str


class Broken(msgspec.Struct, tag="x"):
    """The prefill broke the pair (its payload channel failed, or a fault was injected): the decode
    side fails what was in flight on it now, and waits for the next Hello."""

    p: str
    gen: int
    why: str


Message = Union[Hello, Begin, Commit, Abort, Broken]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def _context() -> zmq.Context:
    # One context per process: `inproc://` endpoints only connect sockets of the same context.
    return zmq.Context.instance()


class Inbox:
    """Decode side: the PULL socket every prefill peer pushes to. Used by one thread (`recv`).
    secret: the cluster's (cluster/wire/frame_auth.py): a frame without its MAC is dropped and counted.
    receiver: this worker's id and incarnation, which the MAC binds (a frame for another worker, or an
    earlier incarnation of this one, is dropped). Bounded (socket_bounds.py): frames of at most
    MAX_KV_CONTROL_FRAME bytes, at most _MAX_QUEUED held per peer before any MAC is checked."""

    def __init__(self, host: str | None, name: str, secret: bytes = b"", receiver: str = ""):
        self._sock = bound(_context().socket(zmq.PULL), MAX_KV_CONTROL_FRAME, _MAX_QUEUED)
        self._sock.setsockopt(zmq.LINGER, 0)
        if host is None:
            self.endpoint = f"inproc://pdserve-kv/{name}/{id(self)}"
            self._sock.bind(self.endpoint)
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self.endpoint = f"tcp://{host}:{port}"
        # HAZARD: the wake pipe's descriptors are plain ints. Once closed, their numbers go to the next
        # file the process opens; a wake() or a read after close() would write into or drain that
        # file (it corrupted a multiprocessing queue's pipe and a TCPStore client's socket in later
        # tests: test_tp_transfer hung in full-suite runs). `_lock` and `_closed` make both a no-op.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._lock = threading.Lock()
        self._closed = False
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.dropped = 0  # frames that were not a control message, or not from a holder of the secret
        self._verifier = FrameVerifier(secret, KV_CONTROL, receiver.encode())

    def recv(self, timeout_s: float) -> list[Message]:
        """Messages that arrived (possibly none); waits up to timeout_s for the first one or a wake()."""
        if self._closed:
            raise ConnectionError("the KV control inbox is closed")
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        with self._lock:
            if self._closed:  # (the poll may have seen another file under a recycled number)
                raise ConnectionError("the KV control inbox is closed")
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
        out = []
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            raw = self._verifier.open(parts)
            if raw is None:  # not from a holder of the cluster's secret (or a replay): never decoded
                self.dropped += 1
                _rejections.warn("dropped a KV control frame without a valid MAC (%d so far)", self._verifier.rejected)
                continue
            try:
                out.append(_DECODER.decode(raw))  # data only: nothing on this socket is ever unpickled
            except msgspec.DecodeError:
                self.dropped += 1
                _rejections.warn("dropped a KV control frame that is not a control message (%d bytes)", len(raw))

    @property
    def rejected(self) -> int:
        """Frames dropped for a missing or bad MAC."""
        return self._verifier.rejected

    def wake(self) -> None:
        """Any thread: makes a pending or the next recv() return at once; after close(), nothing."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: a wake is pending anyway

    def close(self) -> None:
        """Once; any thread. A recv() in progress raises ConnectionError when its poll returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)


class Outbox:
    """Prefill side: the PUSH socket to one decode worker. Thread-safe (one lock per socket); every
    frame carries a MAC under the cluster's secret."""

    def __init__(self, endpoint: str, secret: bytes = b"", receiver: str = ""):
        self._sock = bound(_context().socket(zmq.PUSH), MAX_KV_CONTROL_FRAME, _MAX_QUEUED)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._signer = FrameSigner(secret, KV_CONTROL, receiver.encode())

    def send(self, msg: Message) -> None:
        """Queues one message; never blocks. Raises ConnectionError if the peer stopped reading."""
        raw = _ENCODER.encode(msg)
        with self._lock:  # (the signer's counter too: frames go out in the order they are signed)
            try:
                self._sock.send_multipart(self._signer.sign(raw), zmq.NOBLOCK)
            except zmq.Again:
                raise ConnectionError(f"{_MAX_QUEUED} control messages queued for a peer that does not read them") from None

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)
