"""ProcessTemplate: starts `python -m <module>` children by forking a template process that imported
their heavy libraries once (cluster/process/template_server.py), instead of a new interpreter each.

An API server imports torch (through transformers and xgrammar), transformers' tokenizer machinery,
FastAPI and uvicorn: ~2.5 s of CPU before it reads its first byte, ~1 s for the KV store's process
(torch). A launcher starting K API servers and a store pays that K+1 times; a process that starts
many clusters (a notebook, a test run) pays it for every cluster. From a template each child costs a
fork and what is its own (its tokenizer, its sockets).

- `shared(preload)`: this process's template for that list, started on first use (it returns at
  once: the first spawn waits for the imports) and kept while
  this process lives. A template whose environment no longer matches os.environ (its modules read
  some variables at import) is retired, and a new one started; a retired template exits once its
  last child ended.
- `spawn(...)`: like subprocess.Popen([sys.executable, "-m", module, *args], ...) with stdin/stdout
  None (inherited) or PIPE, stderr inherited, close_fds, `pass_fds`, an environment of os.environ
  plus `env`, and `new_session`; returns a TemplateChild.
- The template exits when this process closes its control socket or dies; its children watch their
  parent (the template: `pid`) and stop when it goes.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import ClassVar, Sequence

import msgspec

from cluster.process.template_child import TemplateChild
from cluster.process.template_messages import Exited, FromTemplate, Ready, Spawn, SpawnFailed, Spawned

log = logging.getLogger("pdserve.process_template")

PIPE = subprocess.PIPE
READY_TIMEOUT_S = 300.0  # the template's imports (seconds; minutes on a loaded 2-core machine)
SPAWN_TIMEOUT_S = 30.0
# Rewritten by pytest around every test phase; nothing a template preloads reads it.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _env_key(env) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k not in _VOLATILE_ENV)


class ProcessTemplate:
    _shared: ClassVar[dict[tuple[str, ...], ProcessTemplate]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, preload: Sequence[str], ready_timeout_s: float = READY_TIMEOUT_S):
        self.preload = tuple(preload)
        self._env = _env_key(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen([sys.executable, "-m", "cluster.process.template_server",
                                       str(theirs.fileno()), *self.preload],
                                      stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        theirs.close()
        self._decode = msgspec.msgpack.Decoder(FromTemplate).decode
        self._encode = msgspec.msgpack.Encoder().encode
        self._lock = threading.Lock()  # one Spawn in flight: its reply is the next Spawned/SpawnFailed
        self._replies: queue.Queue = queue.Queue()
        self._children: dict[int, TemplateChild] = {}
        self._early_exits: dict[int, int] = {}  # Exited read before spawn() registered its child
        self._state = threading.Lock()
        self._alive = True
        self.retired = False
        self.ready: Ready | None = None
        self._failed: str | None = None
        self._ready_timeout_s = ready_timeout_s
        self._reader = threading.Thread(target=self._read, name="process-template-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> None:
        """Under _lock: until the template imported its modules (the first spawn waits for them).
        A template that failed stays failed: every later spawn raises at once."""
        if self.ready is not None:
            return
        if self._failed is None:
            try:
                first = self._replies.get(timeout=self._ready_timeout_s)
            except queue.Empty:
                first = None
            if not isinstance(first, Ready):
                self._failed = f"the process template did not start (exit code {self._proc.poll()})"
            elif first.threads != 1:
                # A fork copies only the forking thread: whatever the others held (locks) stays held.
                self._failed = (f"the process template has {first.threads} threads after importing "
                                f"{', '.join(self.preload)}; forking it is unsafe")
            else:
                self.ready = first
                return
            self._alive = False  # (shared() starts a new one)
            threading.Thread(target=self.close, daemon=True).start()
        raise RuntimeError(self._failed)

    @classmethod
    def shared(cls, preload: Sequence[str]) -> ProcessTemplate:
        key = tuple(preload)
        with cls._shared_lock:
            t = cls._shared.get(key)
            if t is not None and (not t.alive or t._env != _env_key(os.environ)):
                changed = sorted({k for k, _ in t._env ^ _env_key(os.environ)})
                log.info("a new process template: %s", f"the environment changed ({', '.join(changed)})"
                         if t.alive else "the last one is gone")
                t.retire()
                t = None
            if t is None:
                t = cls._shared[key] = cls(key)
            return t

    @property
    def pid(self) -> int:
        """The template's pid: its children's parent."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._alive and self._proc.poll() is None

    def spawn(self, module: str, args: Sequence[str] = (), *, stdin: int | None = None, stdout: int | None = None,
              pass_fds: Sequence[int] = (), env: dict[str, str] | None = None,
              new_session: bool = False) -> TemplateChild:
        mine: list[int] = []  # our ends of the pipes
        theirs: list[int] = []  # what the child gets as 0 and 1 (and closed here once it has them)
        for target, want in ((0, stdin), (1, stdout)):
            if want == PIPE:
                r, w = os.pipe()
                child_end, our_end = (r, w) if target == 0 else (w, r)
                mine.append(our_end)
                theirs.append(child_end)
            elif want is None:
                mine.append(-1)
                theirs.append(target)  # inherited: ours
            else:
                raise ValueError(f"stdin/stdout: None or PIPE, not {want!r}")
        fds = [*theirs, 2, *pass_fds]
        req = Spawn(module=module, args=list(args), env={**os.environ, **(env or {})}, cwd=os.getcwd(),
                    fds=[0, 1, 2, *pass_fds], new_session=new_session)
        try:
            with self._lock:
                self._wait_ready()
                if not self.alive:
                    raise RuntimeError("the process template is gone")
                socket.send_fds(self._sock, [self._encode(req)], fds)
                try:
                    reply = self._replies.get(timeout=SPAWN_TIMEOUT_S)
                except queue.Empty:
                    # A late answer would be read as the next spawn's: this template is done.
                    reply = SpawnFailed(f"no answer within {SPAWN_TIMEOUT_S:g}s")
                    self._alive = False
                    threading.Thread(target=self.close, daemon=True).start()
            if not isinstance(reply, Spawned):
                raise RuntimeError(f"the process template could not start {module}: "
                                   f"{getattr(reply, 'error', 'it is gone')}")
        except BaseException:
            for fd in mine:
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd, want in zip(theirs, (stdin, stdout)):
                if want == PIPE:
                    os.close(fd)
        child = TemplateChild(reply.pid, [sys.executable, "-m", module, *args],
                              os.fdopen(mine[0], "wb") if stdin == PIPE else None,
                              os.fdopen(mine[1], "rb") if stdout == PIPE else None, lambda: self.alive)
        with self._state:
            self._children[reply.pid] = child
            if reply.pid in self._early_exits:
                self._ended(reply.pid, self._early_exits.pop(reply.pid))
        return child

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            msg = self._decode(data)
            if isinstance(msg, Exited):
                with self._state:
                    if msg.pid in self._children:
                        self._ended(msg.pid, msg.code)
                    else:
                        self._early_exits[msg.pid] = msg.code
            else:
                self._replies.put(msg)
        self._alive = False
        self._replies.put(None)  # a spawn() waiting for its reply fails now

    def _ended(self, pid: int, code: int) -> None:
        """Under _state."""
        self._children.pop(pid)._exited(code)
        if self.retired and not self._children:
            threading.Thread(target=self.close, daemon=True).start()

    def retire(self) -> None:
        """No more spawns; the template exits once its last child ended (at once without any)."""
        with self._state:
            self.retired = True
            idle = not self._children
        if idle:
            self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes the control socket: the template exits (its children then stop: they watch it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()
