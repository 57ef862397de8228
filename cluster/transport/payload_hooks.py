"""What a KV transport's payload implements: the hooks ControlledTransport's two sides call (with
`pair.io` held where they touch a channel), and the helpers payloads share. torch_dist.py (NCCL/gloo
point-to-point) and same_gpu.py (CUDA IPC copies) implement them; tp_payload.py's follower agents use
the helpers."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cluster.transport.channel import Commit, Hello
    from cluster.transport.completion import Completion
    from cluster.transport.out_bundle import OutBundle
    from cluster.transport.pair import Pair
    from cluster.transport.plan import ItemPlan, Launch
    from cluster.transport.receiver_side import InBundle


def on_stream(stream, device):
    """Makes a pair's CUDA stream current, on the cache's device; nothing without one (CPU). Shared by
    rank 0's transport and its tensor-parallel followers' payload agents (tp_payload.py)."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def kv_payload_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor a transport moves: an FP8 cache as its uint8 view (same storage: the model's writes
    are what is sent; the payloads send bytes and gloo has no float8 type), any other cache as it is."""
    if kv_cache.element_size() == 1 and kv_cache.dtype != torch.uint8:
        return kv_cache.view(torch.uint8)
    return kv_cache


class PayloadHooks(ABC):
    """How the bytes move, per pair: forming the channel, planning and issuing a bundle's launches,
    posting the receives, aborting, releasing. `kv_cache` is the transport's (the tensor moved)."""

    kv_cache: torch.Tensor

    def _setup_payload(self) -> None:
        """Per-transport payload state (before any thread starts)."""

    @abstractmethod
    def _payload_plan(self) -> tuple[str, int]:
        """(the payload's name, its PlanSpec.chunk_bytes): what the peer's must equal."""

    def _payload_info(self) -> dict:
        """Decode side: extras published with the control endpoint."""
        return {}

    @abstractmethod
    def _plan(self, pair: Pair, srcs: list[tuple[int, ...]], dsts: list[tuple[int, ...]],
              layerwise: bool) -> tuple[list[ItemPlan], list[Launch]]:
        """The bundle's items and launches over the pair's spec (`pair.spec`); both sides must compute
        the same."""

    @abstractmethod
    def _payload_prepare(self, pair: Pair, info: dict) -> list[bytes]:
        """Prefill, connecting: per-pair state from the decode side's info; returns the doorbell
        events' IPC handles the hello carries (same-GPU), or none."""

    @abstractmethod
    def _payload_warm(self, pair: Pair) -> None:
        """Prefill, after the hello: form the channel and move one tiny transfer through it."""

    def _payload_admit(self, pair: Pair, hello: Hello) -> None:
        """Decode, on a hello, before answering it: reserve what the pair's payload needs (raise to
        refuse the pair; the prefill reads why)."""

    @abstractmethod
    def _payload_accept(self, pair: Pair, hello: Hello) -> None:
        """Decode, after answering "ok": form the channel and take the tiny transfer."""

    @abstractmethod
    def _payload_issue(self, pair: Pair, b: OutBundle, launch: Launch, ready) -> None:
        """Prefill: enqueue one launch once `ready` (an event on the compute stream, or None)."""

    @abstractmethod
    def _payload_seal(self, pair: Pair, b: OutBundle) -> tuple[Completion, int]:
        """Prefill, after the last launch: the bundle's completion, and the doorbell event the commit
        names (same-GPU; else -1)."""

    @abstractmethod
    def _payload_post(self, pair: Pair, b: InBundle) -> tuple[Completion, str | None]:
        """Decode: post the whole bundle's receives; the completion covers whatever was posted, with
        an error if posting failed part way."""

    def _payload_commit(self, pair: Pair, b: InBundle, msg: Commit) -> None:
        """Decode: the commit arrived (same-GPU binds the completion event it names)."""

    def _payload_kill(self, pair: Pair, bundles: list, then: Callable[[], None]) -> None:
        """Fault injection ("transfer", prefill side): tear the pair's channel down as a failed link
        would, so that the decode side's receives in flight fail now, then `then()` (the pair is
        marked broken and the decode side told). By default the abort, at once."""
        self._payload_abort(pair)
        then()

    @abstractmethod
    def _payload_abort(self, pair: Pair) -> None:
        """Tear down the pair's channel so nothing in flight can still complete or write."""

    def _payload_release(self, pair: Pair) -> None:
        """The pair is gone for good (its peer restarted, or this transport closed): give back what its
        payload holds (staging memory). Anything still in flight was aborted or ends on its own."""

    def _payload_metrics(self) -> dict:
        """Extra entries for metrics() (torch_dist: staging memory reserved)."""
        return {}

    def _payload_mark(self):
        """A CUDA event on the current (compute) stream: the KV enqueued so far is ready then."""
        if not self.kv_cache.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.kv_cache.device))
        return ev

    def _on_stream(self, stream):
        return on_stream(stream, self.kv_cache.device)
