"""Bounds on the cluster's own ZMQ sockets, and where a process's private sockets live.

A frame is checked (cluster/wire/frame_auth.py) only once ZMQ has received all of it; so, before any MAC is
checked, what a sender without the secret can make a receiver hold must be bounded:

- `bound(sock, max_frame, queued)`: ZMQ_MAXMSGSIZE (a peer sending a larger frame is disconnected
  before it is held) and finite high-water marks (frames queued per peer; past it ZMQ stops reading
  from that peer, or a non-blocking send fails: the sender drops, it never waits).
- `RateLimitedLog`: a rejected frame is counted always, logged at most once per interval (a flood of
  forgeries must not become a flood of log lines).
- `close_on_collect(owner, ctx, socks)`: an owner of a ZMQ context dropped without its close() must
  not hang the process when the garbage collector takes it (below).
- `private_endpoint(name)`: an `ipc://` path in a directory only this user can enter (0700), for the
  channels between a worker's own processes (its publisher process, its tensor-parallel ranks): no
  other local user can connect to them, so they need no MAC. `check_private_endpoint` is what the
  connecting side runs on an endpoint it read from somewhere (a store): one that is not such a path
  is refused.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import weakref

# Frame-size limits per channel (bytes). Each is far above the largest legitimate frame: a KV Begin
# carries 4 bytes per source block of every transfer in a bundle; a token batch a few hundred deltas.
MAX_KV_CONTROL_FRAME = 64 << 20
MAX_TOKEN_FRAME = 64 << 20
MAX_STATS_FRAME = 16 << 20
MAX_DISPATCH_FRAME = 64 << 20  # one prompt's task: ~5 bytes per prompt token
MAX_ANSWER_FRAME = 1 << 20  # one prompt's PrefillResult: a few hundred bytes
MAX_INTERNAL_FRAME = 256 << 20  # a worker's own processes (publisher, tensor-parallel ranks)
RECV_QUEUED = 10_000  # frames a receiving socket holds per peer before ZMQ stops reading from it


def bound(sock, max_frame: int, queued: int = RECV_QUEUED):
    """Sets the socket's maximum frame size and both high-water marks; returns it."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.RCVHWM, queued)
    sock.setsockopt(zmq.SNDHWM, queued)
    return sock


class RateLimitedLog:
    """`warn(msg, *args)` logs at most once per `interval_s`, saying how many were suppressed
    (`exc_info=True` inside an except block: with the traceback of the one it logs)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self._log = logger
        self._interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def warn(self, msg: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._next = self._suppressed, 0, now + self._interval_s
        if suppressed:
            msg += f" ({suppressed} more like it in the last {self._interval_s:.0f} s)"
        self._log.warning(msg, *args, exc_info=exc_info)


_PRIVATE_DIR: str | None = None
_PRIVATE_LOCK = threading.Lock()
_MAX_IPC_PATH = 100  # sun_path holds 108 bytes


def close_on_collect(owner, ctx, socks: list) -> None:
    """When `owner` is collected: close `socks` (a list the owner may append to), then terminate
    `ctx`. HAZARD: an owner dropped without close() is collected in one cycle with its context and
    sockets; weak references are cleared before finalizers run, so `Context.__del__` finds no socket to
    close and its term() blocks for ever on the ones still open (seen: a test run stuck 600 s in a
    garbage-collection pass). The finalizer holds them, so they outlive the owner and go in order."""
    def close() -> None:
        for sock in socks:
            try:
                sock.close(linger=0)
            except Exception:  # noqa: BLE001 - its event loop may be gone: the socket closes all the same
                pass
        if not ctx.closed:
            ctx.term()
    weakref.finalize(owner, close).atexit = False


def _private_dir() -> str:
    """This process's directory for its sockets: made 0700, owned by this user (mkdtemp does both)."""
    global _PRIVATE_DIR
    with _PRIVATE_LOCK:
        if _PRIVATE_DIR is None:
            base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
            if len(base) > 40:
                base = tempfile.gettempdir()
            _PRIVATE_DIR = tempfile.mkdtemp(prefix="pdserve-", dir=base)
            atexit.register(shutil.rmtree, _PRIVATE_DIR, True)
        return _PRIVATE_DIR


def private_endpoint(name: str) -> str:
    """A fresh `ipc://` endpoint in this process's private directory (bind it; connect from this
    user's processes on this node only)."""
    path = os.path.join(_private_dir(), f"{name[:24]}-{uuid.uuid4().hex[:12]}")
    if len(path) > _MAX_IPC_PATH:
        raise OSError(f"ipc path too long for a unix socket: {path}")
    return f"ipc://{path}"


def check_private_endpoint(endpoint: str) -> str:
    """Raises unless `endpoint` is an `ipc://` path whose directory is this user's and closed to every
    other (0700): what a process may connect a worker-internal channel to. Returns it."""
    if not endpoint.startswith("ipc://"):
        raise PermissionError(f"a worker-internal channel must be an ipc:// endpoint, not {endpoint!r}")
    directory = os.path.dirname(endpoint[len("ipc://"):])
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise PermissionError(f"the directory of {endpoint!r} is not there: {e}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{endpoint!r} is not in a private directory of this user (owner {st.st_uid}, "
                              f"mode {oct(st.st_mode & 0o777)})")
    return endpoint
