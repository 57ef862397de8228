"""A test double of a two-rank ProcessGroupNCCL for one GPU (NCCL refuses two ranks on one device), so
the CUDA code of the torch_dist payload (pair streams, pinned id uploads, staging ring ordering, event
completions) runs with both ends in one process.

It keeps the stream semantics the payload relies on (torch_dist.py's docstring): an op, at the
`_end_coalescing` that launches it, waits for the stream current at that call (an event recorded
there); `work.wait()` makes the *current* stream wait for the op's end. A send and a receive are
matched in posting order (as NCCL's point-to-point ops of one communicator are) and moved by a copy on
a "wire" stream of its own that waits for both posting events, sometimes after a delay kernel so that
the streams interleave differently from run to run. Unlike NCCL, a wait() on a receive whose send was
not posted yet blocks the host until it is (the GPU would wait instead): slower, same order.
"""

from __future__ import annotations

import inspect

import random
import threading
from collections import deque

import torch

_GROUPS: dict[str, "LoopbackGroup"] = {}
_LOCK = threading.Lock()


class LoopbackWork:
    def __init__(self):
        self._ready = threading.Event()
        self.done: torch.cuda.Event | None = None
        self.failed: str | None = None

    def _finish(self, ev: torch.cuda.Event | None, failed: str | None = None) -> None:
        self.done, self.failed = ev, failed
        self._ready.set()

    def wait(self) -> bool:
        if not self._ready.wait(60):
            raise RuntimeError("loopback op never matched within 60 s")
        if self.failed is not None:
            raise RuntimeError(self.failed)
        torch.cuda.current_stream().wait_event(self.done)
        return True

    def is_completed(self) -> bool:
        return self._ready.is_set() and (self.done is None or self.done.query())

    def exception(self):
        return RuntimeError(self.failed) if self.failed is not None else None


class LoopbackGroup:
    """What both ranks share: the posted and not yet matched ops, and the wire stream."""

    def __init__(self, device, seed: int):
        self.cv = threading.Lock()
        self.sends: deque = deque()
        self.recvs: deque = deque()
        self.wire = torch.cuda.Stream(device)
        self.rng = random.Random(seed)
        self.aborted = False
        self.moved = 0

    def post(self, kind: str, tensor: torch.Tensor, ev: torch.cuda.Event, work: LoopbackWork) -> None:
        with self.cv:
            if self.aborted:
                work._finish(None, "loopback group aborted")
                return
            (self.sends if kind == "send" else self.recvs).append((tensor, ev, work))
            while self.sends and self.recvs:
                (s, s_ev, s_work), (r, r_ev, r_work) = self.sends.popleft(), self.recvs.popleft()
                if s.numel() * s.element_size() != r.numel() * r.element_size():
                    err = f"size mismatch: send {s.numel()} x {s.dtype}, receive {r.numel()} x {r.dtype}"
                    s_work._finish(None, err)
                    r_work._finish(None, err)
                    continue
                with torch.cuda.stream(self.wire):
                    self.wire.wait_event(s_ev)
                    self.wire.wait_event(r_ev)
                    if self.rng.random() < 0.5:
                        torch.cuda._sleep(self.rng.randrange(1, 200_000))  # a slow wire, now and then
                    r.view(torch.uint8).copy_(s.view(torch.uint8))
                    done = torch.cuda.Event()
                    done.record(self.wire)
                self.moved += 1
                s_work._finish(done)
                r_work._finish(done)

    def abort(self) -> None:
        with self.cv:
            self.aborted = True
            for _, _, w in [*self.sends, *self.recvs]:
                w._finish(None, "loopback group aborted")
            self.sends.clear()
            self.recvs.clear()


class LoopbackPG:
    """One rank's view: the subset of ProcessGroupNCCL the payload calls."""

    def __init__(self, group: LoopbackGroup):
        self.group = group
        self._batch: list | None = None

    def _start_coalescing(self) -> None:
        self._batch = []

    def send(self, tensors, peer: int, tag: int) -> None:
        assert self._batch is not None, "the payload posts point-to-point ops inside a coalesced group"
        self._batch.append(("send", tensors[0]))

    def recv(self, tensors, peer: int, tag: int) -> None:
        assert self._batch is not None, "the payload posts point-to-point ops inside a coalesced group"
        self._batch.append(("recv", tensors[0]))

    def _end_coalescing(self) -> LoopbackWork:
        ev = torch.cuda.Event()
        ev.record()  # the op waits for the stream current now (ProcessGroupNCCL's rule)
        work = LoopbackWork()
        batch, self._batch = self._batch, None
        for kind, t in batch:
            self.group.post(kind, t, ev, work)
        return work

    def abort(self) -> None:
        self.group.abort()


def install(monkeypatch, seed: int = 0) -> dict[str, LoopbackGroup]:
    """TorchDistPayload forms LoopbackPGs instead of NCCL groups (both ends in this process)."""
    from cluster.transport import torch_dist

    def form(self, peer: str, peer_inc: int, gen: int, link) -> None:  # (TorchDistPayload._form's signature)
        me, them = f"{self.worker_id}.{self.incarnation}", f"{peer}.{peer_inc}"
        pair = f"{me}/{them}" if self.role == "prefill" else f"{them}/{me}"
        key = f"{self.ns}/{pair}/g{gen}/L{link.index}"  # per pair generation and link, as the real rendezvous
        with _LOCK:
            group = _GROUPS.setdefault(key, LoopbackGroup(self.kv_cache.device, seed))
        rank = 0 if self.role == "prefill" else 1
        link.pg, link.peer_rank, link.stream = LoopbackPG(group), 1 - rank, torch.cuda.Stream(self.kv_cache.device)

    real = inspect.signature(torch_dist.TorchDistPayload._form).parameters
    if list(inspect.signature(form).parameters) != list(real):
        raise TypeError(f"loopback form{tuple(inspect.signature(form).parameters)} no longer matches "
                        f"TorchDistPayload._form{tuple(real)}")
    monkeypatch.setattr(torch_dist.TorchDistPayload, "_form", form)
    return _GROUPS
