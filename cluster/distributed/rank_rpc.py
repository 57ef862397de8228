"""RankRPC: calls from rank 0 of a tensor-parallel worker to its followers, off the step channel, and
notifications back (the KV transport's payload agents use it: cluster/transport/tp_payload.py).

The step channel (step_channel.py) carries the passes, in order, to each follower's main loop. Work that
is not a pass (forming a follower's KV links, posting its receives for a bundle that arrives while the
decode loop runs, aborting a dead peer's links) goes here instead: each follower serves calls on a
thread of its own, in the order rank 0 made them, and can send rank 0 a notification at any time (a
bundle's payload is done on this rank). Bodies are bytes (the caller's msgspec messages); the envelopes
are msgspec too. ZMQ PUSH/PULL on private ipc:// paths, like the step channel (step_channel.py): no
other local user can send a rank a forged call or a forged Done.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from typing import Callable

import msgspec
import zmq

from cluster.wire.socket_bounds import MAX_INTERNAL_FRAME, bound, check_private_endpoint, private_endpoint

log = logging.getLogger(__name__)

_MAX_QUEUED = 1 << 14


class Call(msgspec.Struct, tag="c", array_like=True):
    id: int
    body: bytes


class Reply(msgspec.Struct, tag="r", array_like=True):
    rank: int
    id: int
    ok: bool
    body: bytes = b""
    error: str = ""


class Notify(msgspec.Struct, tag="n", array_like=True):
    rank: int
    body: bytes


_ENC = msgspec.msgpack.Encoder()
_TO_FOLLOWER = msgspec.msgpack.Decoder(Call)
_TO_LEADER = msgspec.msgpack.Decoder(Reply | Notify)


def _push(endpoint: str):
    s = bound(zmq.Context.instance().socket(zmq.PUSH), MAX_INTERNAL_FRAME, _MAX_QUEUED)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(check_private_endpoint(endpoint))
    return s


def _pull():
    s = bound(zmq.Context.instance().socket(zmq.PULL), MAX_INTERNAL_FRAME, _MAX_QUEUED)
    s.setsockopt(zmq.LINGER, 0)
    endpoint = private_endpoint("tp-rpc")
    s.bind(endpoint)
    return s, endpoint


class RankRPC:
    """One rank's end: `bind()` before the group's ranks exchange endpoints, `connect()` after."""

    def __init__(self, rank: int):
        self.rank = rank
        self._in, self.endpoint = _pull()
        self._out: dict[int, object] = {}  # rank -> PUSH socket (rank 0: every follower; a follower: rank 0)
        self._locks: dict[int, threading.Lock] = {}
        self._ids = itertools.count()
        self._futures: dict[int, Future] = {}
        self._futures_lock = threading.Lock()
        self.on_call: Callable[[bytes], bytes] | None = None  # a follower: serves rank 0's calls
        self.on_notify: Callable[[int, bytes], None] | None = None  # rank 0: a follower's notification
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def connect(self, endpoints: dict[int, str]) -> None:
        """endpoints: the other ranks' RankRPC endpoints (rank 0 connects to every follower, a follower
        to rank 0); starts this end's serving thread."""
        peers = [r for r in endpoints if r != self.rank] if self.rank == 0 else [0]
        for r in peers:
            self._out[r] = _push(endpoints[r])
            self._locks[r] = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"tp-rpc-{self.rank}", daemon=True)
        self._thread.start()

    def _send(self, rank: int, msg) -> None:
        raw = _ENC.encode(msg)
        with self._locks[rank]:
            try:
                self._out[rank].send(raw, zmq.NOBLOCK)
            except zmq.Again:
                raise ConnectionError(f"{_MAX_QUEUED} RPC frames queued for rank {rank}, which does not read them") from None

    # -- rank 0 ---------------------------------------------------------------------------------
    def call(self, rank: int, body: bytes) -> Future:
        """Rank 0: the follower runs on_call(body); the future resolves to its reply body (or raises)."""
        fut: Future = Future()
        i = next(self._ids)
        with self._futures_lock:
            self._futures[i] = fut
        try:
            self._send(rank, Call(i, body))
        except Exception as e:  # noqa: BLE001
            with self._futures_lock:
                self._futures.pop(i, None)
            fut.set_exception(e)
        return fut

    # -- a follower -------------------------------------------------------------------------------
    def notify(self, body: bytes) -> None:
        self._send(0, Notify(self.rank, body))

    # -- the serving thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                raw = self._in.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return  # closed
            try:
                if self.rank == 0:
                    self._leader_frame(_TO_LEADER.decode(raw))
                else:
                    self._follower_frame(_TO_FOLLOWER.decode(raw))
            except msgspec.DecodeError:
                log.error("rank %d dropped an RPC frame that is not one (%d bytes)", self.rank, len(raw))
            except Exception:  # noqa: BLE001 - a handler's own failure is its reply's; this is ours
                log.exception("rank %d: RPC frame failed", self.rank)

    def _leader_frame(self, msg) -> None:
        if isinstance(msg, Notify):
            if self.on_notify is not None:
                self.on_notify(msg.rank, msg.body)
            return
        with self._futures_lock:
            fut = self._futures.pop(msg.id, None)
        if fut is None:
            return
        if msg.ok:
            fut.set_result(msg.body)
        else:
            fut.set_exception(RuntimeError(f"rank {msg.rank}: {msg.error}"))

    def _follower_frame(self, msg: Call) -> None:
        try:
            if self.on_call is None:
                raise RuntimeError("this rank serves no calls")
            reply = Reply(self.rank, msg.id, True, self.on_call(msg.body) or b"")
        except Exception as e:  # noqa: BLE001 - the caller gets it
            reply = Reply(self.rank, msg.id, False, error=f"{type(e).__name__}: {e}")
        self._send(0, reply)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        for s in self._out.values():
            s.close(linger=0)
        self._in.close(linger=0)
        with self._futures_lock:
            pending, self._futures = list(self._futures.values()), {}
        for f in pending:
            if not f.done():
                f.set_exception(RuntimeError("the tensor-parallel group closed"))
