"""The messages between a launcher (ProcessTemplate) and its template process (TemplateServer), one
per SOCK_SEQPACKET datagram, msgpack-encoded; a Spawn's file descriptors ride with it (SCM_RIGHTS)."""

from __future__ import annotations

import msgspec


class Spawn(msgspec.Struct, tag=True, frozen=True):
    """Fork a child that runs `python -m module *args`. The datagram carries len(fds) descriptors; the
    child gets descriptor i as number fds[i] (0, 1 and 2 always; the rest as `pass_fds`)."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]
    new_session: bool = False


class Spawned(msgspec.Struct, tag=True, frozen=True):
    pid: int


class SpawnFailed(msgspec.Struct, tag=True, frozen=True):
    error: str


class Exited(msgspec.Struct, tag=True, frozen=True):
    """A child ended: `code` as Popen.returncode reads it (-N: killed by signal N)."""

    pid: int
    code: int


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The template imported its modules; `threads`: its Python threads then (a fork copies only the
    caller's)."""

    pid: int
    threads: int
    cpu_s: float


ToTemplate = Spawn
FromTemplate = Spawned | SpawnFailed | Exited | Ready
