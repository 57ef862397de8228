"""TemplateChild: the launcher's handle on one process a ProcessTemplate forked, with the part of
subprocess.Popen's interface the launcher uses (pid, stdin, stdout, poll, wait, returncode,
send_signal, kill).

The child is the template's, not the launcher's: only the template can reap it, and it reports the
exit code (ProcessTemplate's reader calls `_exited`). Should the template die first, its children
are re-parented and reaped by someone else; a child then reads as ended once its pid is gone, with
code TEMPLATE_GONE.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import IO

TEMPLATE_GONE = 255  # the exit code of a child whose template died before reporting it


class TemplateChild:
    def __init__(self, pid: int, args: list[str], stdin: IO[bytes] | None, stdout: IO[bytes] | None,
                 template_alive):
        self.pid = pid
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._done = threading.Event()
        self._template_alive = template_alive  # () -> bool

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        if self._done.is_set():
            return self.returncode
        if not self._template_alive() and not _pid_running(self.pid):
            self._exited(TEMPLATE_GONE)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._done.wait(0.05 if left is None else min(0.05, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # NOTE: until the template reports the exit, the pid is its unreaped child (a zombie at worst),
        # so it cannot have been reused by another process.
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
