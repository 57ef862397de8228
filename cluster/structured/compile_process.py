"""CompileProcess: one grammar compile at a time in a child process, with a deadline that really
stops it.

A compile on a thread cannot be stopped: past its deadline the request fails, but the thread goes on
compiling (a pathological grammar: minutes) and a few distinct such grammars pin every compile
thread of a worker. Here the compile runs in a child (`python -m cluster.structured.compile_process`,
forked from the worker's process template: cluster/process/) that built the same backend from the
parent's export (`GrammarBackend.export`, the tokenizer's table: no tokenizer load); past the deadline
the child is killed and the next compile starts a new one. The compiled grammar comes back serialized
(`GrammarBackend.serialize`), read by the parent's backend.

Frames on the child's stdin/stdout pipes (nothing listens on a socket): a 4-byte big-endian length,
then msgpack. In: first {backend, vocab_size, export}, then {kind, spec} per compile. Out: {ready}
once the backend is built (its imports take seconds: not counted in any compile's deadline), then
per compile {ok: serialized} or {error: message}.
"""

from __future__ import annotations

import os
import select
import struct
import sys
import time

import msgspec

from cluster.process.process_template import PIPE, ProcessTemplate
from cluster.process.template_child import TemplateChild

_LEN = struct.Struct(">I")
PRELOAD = ("xgrammar",)  # (and torch, which it imports): most of a compile process's start
START_TIMEOUT_S = 300.0  # the child imports the backend (xgrammar, torch) and builds its vocabulary


class CompileTimeout(Exception):
    pass


def _write(f, obj) -> None:
    data = msgspec.msgpack.encode(obj)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _read_blocking(f):
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    return msgspec.msgpack.decode(f.read(n))


class CompileProcess:
    """The parent's handle on one child. Not thread-safe: one caller at a time (GrammarCompiler keeps
    one per compile thread)."""

    def __init__(self, backend_name: str, vocab_size: int, export: bytes):
        self._init = {"backend": backend_name, "vocab_size": vocab_size, "export": export}
        self._proc: TemplateChild | None = None

    def start(self) -> None:
        """Starts the child (if none runs) and waits until its backend is built."""
        if self._proc is not None and self._proc.poll() is None:
            return
        # Forked from this process's template (cluster/process/), which imported xgrammar and torch
        # once: a child after a killed one (a deadline) starts in tens of ms, not seconds.
        self._proc = ProcessTemplate.shared(PRELOAD).spawn("cluster.structured.compile_process", stdin=PIPE,
                                                           stdout=PIPE)
        try:
            _write(self._proc.stdin, self._init)
            if "ready" not in self._reply(time.monotonic() + START_TIMEOUT_S):
                raise RuntimeError("no ready frame")
        except (CompileTimeout, OSError, EOFError, RuntimeError, struct.error, msgspec.DecodeError) as e:
            self.close()
            raise RuntimeError(f"the grammar compile process did not start: {type(e).__name__} {e}") from None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _reply(self, deadline: float) -> dict:
        (n,) = _LEN.unpack(self._read_exactly(_LEN.size, deadline))
        return msgspec.msgpack.decode(self._read_exactly(n, deadline))

    def compile(self, kind: str, spec: str, timeout_s: float) -> bytes:
        """The serialized compiled grammar; raises CompileTimeout (the child is killed) or
        RuntimeError (the backend refused the grammar, or the child died)."""
        self.start()
        deadline = time.monotonic() + timeout_s
        try:
            _write(self._proc.stdin, {"kind": kind, "spec": spec})
            reply = self._reply(deadline)
        except CompileTimeout:
            self.close()
            raise CompileTimeout(f"the grammar did not compile within {timeout_s:g}s") from None
        except (OSError, EOFError, struct.error, msgspec.DecodeError) as e:
            self.close()
            raise RuntimeError(f"the grammar compile process failed: {e}") from None
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["ok"]

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CompileTimeout()
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError("the compile process exited")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> int:
    from cluster.structured.registry import get_grammar_backend
    from cluster.structured.structured_output import StructuredOutput

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    init = _read_blocking(stdin)
    if init is None:
        return 0
    backend = get_grammar_backend(init["backend"]).from_export(init["export"], init["vocab_size"])
    _write(stdout, {"ready": True})
    while True:
        req = _read_blocking(stdin)
        if req is None:  # the parent closed the pipe (or died)
            return 0
        try:
            reply = {"ok": backend.serialize(backend.compile(StructuredOutput(req["kind"], req["spec"])))}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the request
            reply = {"error": f"{type(e).__name__}: {e}"}
        _write(stdout, reply)


if __name__ == "__main__":
    sys.exit(main())
