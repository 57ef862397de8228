"""Completions: "has this side of a bundle's KV payload finished?", asked without blocking by the
decode loop (`done()`) and waited for by one waiter thread per pair (`wait()`), in order.

    EventCompletion     CUDA: an event recorded on the pair's stream after the payload
    HostCompletion      gloo: payload work the pair's waiter thread runs (sends, receives, scatters)
    DeferredCompletion  same-GPU decode side: the commit names the event to query
    AllCompletion       several of them at once (tensor parallelism: a rank's links, its followers')
    ReadyCompletion     nothing was left to wait for
    WedgedCompletion    fault "stuck_transfer": never done until the pair is given up
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class Completion:
    def done(self) -> bool:
        """Never blocks (the decode loop calls it)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Blocks until done (waiter threads only)."""
        raise NotImplementedError

    def error(self) -> str | None:
        return None

    def abandon(self) -> None:
        """The peer is dead: stop waiting for anything only it could still provide."""


class AllCompletion(Completion):
    """Done when every part is (tensor parallelism: one per link a rank serves, and its followers' parts,
    tp_payload.py); the first part's error is its error."""

    def __init__(self, parts):
        self.parts = list(parts)

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def wait(self) -> None:
        for p in self.parts:
            p.wait()

    def error(self) -> str | None:
        for p in self.parts:
            e = p.error()
            if e is not None:
                return e
        return None

    def abandon(self) -> None:
        for p in self.parts:
            p.abandon()


class ReadyCompletion(Completion):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class EventCompletion(Completion):
    """CUDA: an event recorded on the pair's stream after the payload. `works` (ProcessGroupNCCL work
    objects) carry any error NCCL's watchdog found; `keep` holds tensors the payload uses until then."""

    def __init__(self, event: torch.cuda.Event, works=(), keep=()):
        self.event, self.works, self.keep = event, list(works), keep

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def error(self) -> str | None:
        for w in self.works:
            err = work_error(w)
            if err is not None:
                return err
        return None


def work_error(w) -> str | None:
    """The error a finished torch.distributed work object carries, or None.

    HAZARD: in some torch builds (2.11 on the GPU host) `Work.exception()` cannot return its
    exception_ptr to Python (a pybind11 TypeError, even when there is no error), and NCCL's
    `is_success()` raises NotImplementedError; there the work's result future says it."""
    try:
        w.is_completed()  # refreshes the work's error from its communicator (the watchdog only sees a copy)
        try:
            e = w.exception()
        except TypeError:
            return _work_result_error(w)
    except Exception as x:  # noqa: BLE001 - a broken work object is an error too
        return f"{type(x).__name__}: {x}"
    return None if e is None else f"{type(e).__name__}: {e}"


def _work_result_error(w) -> str | None:
    """Where exception() cannot be read: the work's result future (WorkResult: 0 SUCCESS, 1 TIMEOUT,
    2 COMM_ERROR), which NCCL's watchdog sets once it has seen the work end. Not set yet, or not
    readable (is_success is not implemented for NCCL): no error known here; a dead peer is still
    found by the pair's liveness checks (PeerDeadError)."""
    try:
        fut = w.get_future_result()
        if not fut.done():
            return None
        result = int(fut.value())
    except Exception:  # noqa: BLE001 - unreadable: no error known
        return None
    return None if result == 0 else f"{type(w).__name__} failed (WorkResult {result})"


class HostCompletion(Completion):
    """CPU (gloo): payload work the pair's waiter thread runs, in order with the pair's other work (a
    launch's gather and send, a bundle's receives and scatters, the wait for a bundle's sends); done
    once `run` returned or raised (its error, then)."""

    def __init__(self, run: Callable[[], None], keep=()):
        self.run, self.keep = run, keep
        self._done = threading.Event()
        self._error: str | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if self._done.is_set():
            return
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - reported through error()
            self._error = f"{type(e).__name__}: {e}"
        finally:
            self.keep = ()
            self._done.set()

    def error(self) -> str | None:
        return self._error


class DeferredCompletion(Completion):
    """Known only later: the same-GPU decode side learns from the commit which event to query."""

    def __init__(self):
        self._c: Completion | None = None
        self._bound = threading.Event()

    def bind(self, c: Completion) -> None:
        self._c = c
        self._bound.set()

    def done(self) -> bool:
        return self._c is not None and self._c.done()

    def wait(self) -> None:
        self._bound.wait()
        self._c.wait()

    def error(self) -> str | None:
        return self._c.error() if self._c is not None else None

    def abandon(self) -> None:
        if self._c is None:
            self.bind(ReadyCompletion())


class Waiter(threading.Thread):
    """Waits for one pair's completions in order (they complete in order: one stream per pair)."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self._cv = threading.Condition()
        self._q: deque[tuple[Completion, Callable[[], None]]] = deque()
        self._stopping = False  # (not `_stop`: that is threading.Thread's own, which join() calls)

    def put(self, completion: Completion, then: Callable[[], None]) -> None:
        with self._cv:
            if not self._stopping:
                self._q.append((completion, then))
                self._cv.notify()
                return
        # HAZARD: stopped (the pair was given up: re-formed, or its peer restarted) while a bundle on it
        # was still being sealed or committed. Its `then` must still run (it resolves the transfer's
        # futures), so it gets a thread of its own; its completion was abandoned or fails.
        threading.Thread(target=self._one, args=(completion, then), name=f"{self.name}-late", daemon=True).start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stopping:
                    self._cv.wait()
                if not self._q:
                    return
                c, then = self._q.popleft()
            self._one(c, then)

    @staticmethod
    def _one(c: Completion, then: Callable[[], None]) -> None:
        try:
            c.wait()
        except Exception:  # noqa: BLE001 - a failed wait shows in the completion's error
            log.exception("waiting for a KV payload failed")
        try:
            then()
        except Exception:  # noqa: BLE001
            log.exception("KV completion callback failed")


class WedgedCompletion(Completion):
    """Fault "stuck_transfer": a payload that never completes, until the pair is given up (abandon)."""

    def __init__(self):
        self._given_up = threading.Event()

    def done(self) -> bool:
        return self._given_up.is_set()

    def wait(self) -> None:
        self._given_up.wait()

    def error(self) -> str | None:
        return "the KV payload never completed (the pair's channel wedged)" if self._given_up.is_set() else None

    def abandon(self) -> None:
        self._given_up.set()
