"""TemplateServer: the template process (`python -m cluster.process.template_server FD MODULE...`).

It imports MODULE... once (torch, transformers, xgrammar, FastAPI, uvicorn: ~2.5 s of CPU for an API
server, ~1 s for the KV store's process), then forks one child per Spawn read from its control socket
(the inherited descriptor FD) and runs `python -m <module>` in it with runpy, as a fresh interpreter
would, minus those imports. It tells the launcher each child's pid and, when it reaps one, its exit
code; it exits when the launcher closes the control socket (or dies), and its children, which watch
their parent, then stop too.

Hazards a fork brings, and what is done about them:
- Only the forking thread exists in a child. The template runs no Python thread but its main one
  (Ready reports them; ProcessTemplate refuses a template that runs more) and forks from it. Native
  pools started at import (OpenBLAS's, through numpy) are fork-aware (pthread_atfork), as they are
  for PyTorch's DataLoader workers, which fork the same way.
- A module reads some environment variables at import (prometheus_client reads
  PROMETHEUS_MULTIPROC_DIR): such a module must not be preloaded. The child gets the Spawn's
  environment before it imports anything else, and ProcessTemplate gives a launcher whose
  environment changed a new template.
- Descriptors: the child keeps only 0, 1, 2 and the passed ones (close_fds); the control socket and
  the template's signal pipe are closed in it.
- Random state: `random` is reseeded in the child (os.urandom-based APIs need nothing).
"""

from __future__ import annotations

import atexit
import fcntl
import importlib
import io
import os
import random
import resource
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

import msgspec

from cluster.process.template_messages import Exited, Ready, Spawn, SpawnFailed, Spawned

MAX_FDS = 16  # descriptors one Spawn may carry
MAX_MESSAGE = 1 << 20  # a Spawn's bytes (its environment is the largest part)


class TemplateServer:
    def __init__(self, control: socket.socket):
        self.control = control
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(Spawn).decode
        # SIGCHLD wakes the select loop through a pipe (the handler itself does nothing).
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the launcher's to handle

    def send(self, msg) -> None:
        try:
            self.control.send(self._encode(msg))
        except OSError:
            raise SystemExit(0) from None  # the launcher is gone

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.control, self._wake_r], [], [])
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            self._reap()
            if self.control in ready:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(self.control, MAX_MESSAGE, MAX_FDS)
                except OSError:  # (ECONNRESET: the launcher died with a Spawn unread)
                    data, fds = b"", []
                if not data:
                    return  # the launcher closed its end or died: no more children to start
                try:
                    self._spawn(self._decode(data), fds)
                finally:
                    for fd in fds:
                        os.close(fd)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send(Exited(pid, os.waitstatus_to_exitcode(status)))

    def _spawn(self, req: Spawn, fds: list[int]) -> None:
        if len(fds) != len(req.fds):
            self.send(SpawnFailed(f"{len(fds)} descriptors came for {len(req.fds)} targets"))
            return
        try:
            pid = os.fork()
        except OSError as e:
            self.send(SpawnFailed(f"fork: {e}"))
            return
        if pid == 0:
            code = 1
            try:
                code = self._child(req, fds)
            except BaseException:  # noqa: BLE001 - reported on the child's stderr, exit code 1
                traceback.print_exc()
            finally:
                os._exit(code)
        self.send(Spawned(pid))

    def _child(self, req: Spawn, fds: list[int]) -> int:
        self.control.detach()  # closed below with the rest; its object must never close a reused number
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a new interpreter's)
        if req.new_session:
            os.setsid()
        # Each passed descriptor to its target number: first all above every target (so no move
        # overwrites a descriptor still to be moved), then down to the targets; then close_fds.
        floor = max(req.fds) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
        for src, dst in zip(high, req.fds):
            os.dup2(src, dst)  # (dup2 clears close-on-exec on dst)
        keep = set(req.fds)
        max_fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        max_fd = max_fd if 0 < max_fd < (1 << 20) else 1 << 16
        start = 0
        for fd in sorted(keep) + [max_fd]:
            if fd > start:  # NOTE: os.closerange(a, a) is not empty on every Python (3.11 closes all from a)
                os.closerange(start, fd)
            start = fd + 1
        _set_name(req.module.rsplit(".", 1)[-1])
        os.chdir(req.cwd)
        os.environ.clear()
        os.environ.update(req.env)
        _std_streams(bool(req.env.get("PYTHONUNBUFFERED")))
        random.seed()
        sys.argv = [req.module, *req.args]
        code = 0
        try:
            runpy.run_module(req.module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        # As an interpreter ends: its other non-daemon threads joined, then its atexit functions.
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        return code


def _set_name(name: str) -> None:
    """The child's process name (what `top` and psutil's name() show; its command line stays the
    template's): `api_server`, `store_process`."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _std_streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr anew on descriptors 0-2 (now the Spawn's), buffered as a new
    interpreter's would be (PYTHONUNBUFFERED: unbuffered; a terminal: line-buffered)."""
    def out(fd: int) -> io.TextIOWrapper:
        tty = os.isatty(fd)
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8",
                                errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=tty or fd == 2, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = sys.__stdout__ = out(1)
    sys.stderr = sys.__stderr__ = out(2)


def main() -> int:
    control = socket.socket(fileno=int(sys.argv[1]))
    started = resource.getrusage(resource.RUSAGE_SELF)
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a child that needs it fails there, as it would have without the template
    used = resource.getrusage(resource.RUSAGE_SELF)
    server = TemplateServer(control)
    cpu = used.ru_utime + used.ru_stime - started.ru_utime - started.ru_stime
    server.send(Ready(os.getpid(), threading.active_count(), round(cpu, 3)))
    server.serve()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:  # (send() found the launcher gone)
        code = e.code if isinstance(e.code, int) else 0
    # Not the interpreter's teardown of what it imported (torch's: seconds): nothing to flush.
    os._exit(code)
