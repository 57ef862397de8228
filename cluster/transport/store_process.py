"""StoreProcess: the cluster's rendezvous store (a TCPStore server, rendezvous_store.start_store) in a
child process of the launcher (forked from its process template), so that a client filling the store
fills that child, never the launcher (which also runs the router and supervises the API servers).

- A memory cap: the child sets RLIMIT_DATA to what it uses once torch is imported plus
  `memory_limit_mib`, before the store takes its first connection. An allocation past it fails in the
  child: c10d's libuv backend catches the std::bad_alloc and closes that client's connection, and the
  child goes on serving (test_store_process.py). Should the child die anyway, the launcher is told
  (`exited`, `on_exit`) and drains and stops (deploy/serving_cluster.py, RELIABILITY.md).
- A warden thread (store_warden.py) sweeps every `sweep_s` seconds and removes what no holder of the
  cluster's secret wrote, so a fill is undone before the cap is reached in the usual case.
- No orphan: the child's stdin is a pipe only the launcher holds; the child exits when it reads EOF
  (the launcher stopped it, or died: the kernel closes the pipe either way), and its warden also
  exits if its parent changes (re-parented: the pipe leaked to another process).
  (Not PR_SET_PDEATHSIG: it fires when the *thread* that started the child exits, and a cluster may be
  started from a thread that ends before it stops.)
- The secret reaches the child on that pipe, never in argv or the environment.

Start-up (`start`) does not wait: the child is forked from a process template (cluster/process/:
torch imported once, ~1 s of CPU, in the template) on the reader thread, while the launcher places
the workers; `wait_ready` is called where the port is needed. The child reports on its stdout, one
JSON line each: first {"port", "pid", "cpu_s", "data_limit"} (or {"error"}), then the warden's
totals after a sweep that removed something, and at least every `_REPORT_S`. Its `cpu_s` counts
what it used after the fork only.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Callable

from cluster.errors import PdserveError
from cluster.process.process_template import PIPE, ProcessTemplate
from cluster.process.template_child import TemplateChild

log = logging.getLogger("pdserve.store")

_REPORT_S = 1.0
PRELOAD = ("torch.distributed",)  # what the child imports (rendezvous_store: torch, most of its start)


class StoreProcess:
    """The launcher's handle on the store's child process."""

    def __init__(self, template: ProcessTemplate, settings: dict, host: str, started: float):
        self._template = template
        self._settings = settings
        self._proc: TemplateChild | None = None  # once forked (on the reader thread)
        self._spawned = threading.Event()
        self.host = host
        self._started = started
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._hello: dict = {}
        self._stats: dict = {}
        self._stopping = False
        self.ready_wall_s: float | None = None  # from start() to the child's port reported
        self.on_exit: Callable[[int], None] | None = None  # called (reader thread) when the child dies unasked
        self._reader = threading.Thread(target=self._read, name="store-process-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, host: str, port: int = 0, *, secret: bytes, namespace: str, memory_limit_mib: int = 1024,
              sweep_s: float = 1.0, timeout_s: float = 300.0, template: ProcessTemplate | None = None) -> StoreProcess:
        """Starts the child (returns at once). `sweep_s` 0: no warden (benchmarks, the cap's own test).
        `template`: the process template to fork it from (its preload must include PRELOAD's); by
        default this process's shared one for PRELOAD."""
        template = template or ProcessTemplate.shared(PRELOAD)
        # parent: the template, whose child it is (it ends when the launcher does).
        settings = {"host": host, "port": port, "secret": secret.hex(), "namespace": namespace,
                    "memory_limit_bytes": memory_limit_mib << 20, "sweep_s": sweep_s, "timeout_s": timeout_s,
                    "parent": template.pid}
        return cls(template, settings, host, time.monotonic())

    # -- the child's reports ----------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            # Forked here, not in start(): the first fork waits for the template's imports, while the
            # launcher goes on placing the workers. Its own session: a Ctrl-C at the terminal is the
            # launcher's to handle.
            self._proc = proc = self._template.spawn("cluster.transport.store_process", stdin=PIPE, stdout=PIPE,
                                                     new_session=True)
            proc.stdin.write(json.dumps(self._settings).encode() + b"\n")
            proc.stdin.flush()  # (the pipe stays open: it is the child's lifeline)
        except (OSError, RuntimeError) as e:
            with self._lock:
                self._hello = {"error": f"its process could not start: {e}"}
            self._spawned.set()
            self._ready.set()
            if not self._stopping and self.on_exit is not None:
                self.on_exit(1)
            return
        finally:
            self._spawned.set()
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                if not self._ready.is_set():
                    self._hello = msg
                    self.ready_wall_s = time.monotonic() - self._started
                    self._ready.set()
                else:
                    self._stats = msg
        code = proc.wait()
        self._ready.set()
        if not self._stopping:
            log.error("the KV rendezvous store's process (pid %d) exited with code %d", proc.pid, code)
            if self.on_exit is not None:
                self.on_exit(code)

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        """Blocks until the store listens; returns its port. Raises PdserveError if it did not start."""
        if not self._ready.wait(timeout_s):
            raise PdserveError(f"the KV rendezvous store's process did not start within {timeout_s:g}s")
        with self._lock:
            hello = dict(self._hello)
        if "port" not in hello:
            why = hello.get("error") or f"its process exited with code {self.exited()}"
            raise PdserveError(f"the KV rendezvous store did not start: {why}")
        return hello["port"]

    @property
    def port(self) -> int:
        return self.wait_ready()

    @property
    def pid(self) -> int | None:
        """The child's pid (None before it was forked, or if it could not be)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def startup(self) -> dict:
        """The child's start: its own CPU seconds up to listening, and the wall seconds until the
        launcher read its port (None before)."""
        with self._lock:
            return {"cpu_s": self._hello.get("cpu_s"), "wall_s": self.ready_wall_s,
                    "data_limit": self._hello.get("data_limit")}

    def stats(self) -> dict:
        """The warden's latest totals: sweeps, keys (last listed), deleted, tombstoned, vm_data and
        vm_rss (bytes) of the child."""
        with self._lock:
            return dict(self._stats)

    def exited(self) -> int | None:
        """The child's exit code, or None while it runs (or is being started); 1 if it could not start."""
        if not self._spawned.is_set():
            return None
        return self._proc.poll() if self._proc is not None else 1

    def client(self, timeout_s: float = 10.0):
        """A new raw client of the store (no secret: reads and writes as any client would)."""
        import torch.distributed as dist

        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the child (closing its lifeline), then waits for it; kills it past `timeout_s`. Idempotent."""
        self._stopping = True
        self._spawned.wait()  # (bounded: the template's start times out)
        proc = self._proc
        if proc is not None:
            if proc.stdin and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reader.join(timeout_s)


# -- the child ------------------------------------------------------------------------------------------
def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _report(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0) (a no-op elsewhere): freed heap memory returned to the system."""
    import ctypes

    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: fn(0)


def _warden_loop(settings: dict, secret: bytes) -> None:
    import torch.distributed as dist

    from cluster.transport.store_warden import StoreWarden

    warden, trim = StoreWarden(settings["namespace"], secret), _malloc_trim()
    totals = {"sweeps": 0, "keys": 0, "deleted": 0, "tombstoned": 0, "errors": 0}
    client, reported = None, 0.0
    while True:
        if os.getppid() != settings["parent"]:
            os._exit(0)  # re-parented: the launcher is gone (the lifeline normally says so first)
        try:
            if client is None:
                client = dist.TCPStore(settings["host"], settings["port"], is_master=False, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=10), use_libuv=True)
            r = warden.sweep(client)
            totals["sweeps"] += 1
            totals["keys"] = r.keys
            totals["deleted"] += r.deleted
            totals["tombstoned"] += r.tombstoned
            changed = r.deleted or r.tombstoned
        except Exception as e:  # noqa: BLE001 (a sweep that failed, e.g. MemoryError near the cap: the next one retries)
            totals["errors"] += 1
            print(f"pdserve store warden: sweep failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            client, changed = None, True  # (a client whose replies got out of step never recovers)
        if changed:
            trim()  # the junk's pages back to the system, not only to malloc's free lists
        now = time.monotonic()
        if changed or now - reported >= _REPORT_S:
            _report({**totals, "vm_data": _vm("VmData"), "vm_rss": _vm("VmRSS")})
            reported = now
        time.sleep(settings["sweep_s"])


def _child_main() -> None:
    import resource

    settings = json.loads(sys.stdin.buffer.readline())
    secret = bytes.fromhex(settings.pop("secret"))
    try:
        from cluster.transport.rendezvous_store import start_store  # (imports torch: most of the start)

        # The cap, before the store takes a connection: what the child uses now plus the budget.
        limit = _vm("VmData") + settings["memory_limit_bytes"]
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        store = start_store(settings["host"], settings["port"], timeout_s=settings["timeout_s"])
    except Exception as e:  # noqa: BLE001 (reported to the launcher, which raises it)
        _report({"error": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    settings["port"] = store.port
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    _report({"port": store.port, "pid": os.getpid(), "cpu_s": round(cpu.ru_utime + cpu.ru_stime, 3),
             "data_limit": limit})
    if settings["sweep_s"] > 0:
        threading.Thread(target=_warden_loop, args=(settings, secret), name="store-warden", daemon=True).start()
    sys.stdin.buffer.read()  # the lifeline: EOF when the launcher stops us or dies
    os._exit(0)  # (the store's event loop thread is not joined: nothing to flush)


if __name__ == "__main__":
    _child_main()
