"""KVPayload: how a KV transport's bytes move, one object per transport that both of its sides are
given (sender_side.py, receiver_side.py; the shared link, link.py, aborts and releases pairs through
it). Three implementations: TorchDistPayload (torch_dist.py: NCCL/gloo point-to-point over a staging
ring), SameGPUPayload (same_gpu.py: CUDA IPC copies) and TPPayload (tp_payload.py: a TorchDistPayload
for rank 0's links plus the followers' over the group's RPC). factory.py picks one; `ControlledTransport`
(control.py) names it in its repr and metrics.

The sides call these methods with `pair.io` held where they touch a channel."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cluster.transport.channel import Commit, Hello
from cluster.transport.completion import Completion
from cluster.transport.in_bundle import InBundle
from cluster.transport.out_bundle import OutBundle
from cluster.transport.pair import Pair
from cluster.transport.plan import ItemPlan, Launch
from cluster.transport.transport_spec import TransportSpec


def on_stream(stream, device):
    """Makes a pair's CUDA stream current, on the cache's device; nothing without one (CPU). Shared by
    rank 0's payload and its tensor-parallel followers' payload agents (tp_payload.py)."""
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


@dataclass(frozen=True)
class PayloadEnd:
    """What a payload knows of the worker it moves bytes for: its cache (the tensor moved), who it is
    (the payload channel's rendezvous keys name the worker's incarnation) and how to reach the store."""

    spec: TransportSpec
    kv_cache: torch.Tensor
    worker_id: str
    role: str  # "prefill" | "decode"
    incarnation: int
    new_store: Callable[[], Any]  # a new store client (one per thread: TCPStore clients are not shared)
    tp_rank: int = 0  # this process's rank in its worker's tensor-parallel group


class KVPayload(ABC):
    """How the bytes move, per pair: forming the channel, planning and issuing a bundle's launches,
    posting the receives, aborting, releasing. Per-pair state lives in `pair.payload`, per-bundle state
    in the bundle's `payload`; nothing here reaches back into the sides."""

    kv_cache: torch.Tensor

    @abstractmethod
    def plan_kind(self) -> tuple[str, int]:
        """(the payload's name, its PlanSpec.chunk_bytes): what the peer's must equal."""

    def info(self) -> dict:
        """Decode side: extras published with the control endpoint."""
        return {}

    @abstractmethod
    def plan(self, pair: Pair, srcs: list[tuple[int, ...]], dsts: list[tuple[int, ...]],
             layerwise: bool) -> tuple[list[ItemPlan], list[Launch]]:
        """The bundle's items and launches over the pair's spec (`pair.spec`); both sides must compute
        the same."""

    @abstractmethod
    def prepare(self, pair: Pair, info: dict) -> list[bytes]:
        """Prefill, connecting: per-pair state from the decode side's info; returns the doorbell
        events' IPC handles the hello carries (same-GPU), or none."""

    @abstractmethod
    def warm(self, pair: Pair) -> None:
        """Prefill, after the hello: form the channel and move one tiny transfer through it."""

    def admit(self, pair: Pair, hello: Hello) -> None:
        """Decode, on a hello, before answering it: reserve what the pair's payload needs (raise to
        refuse the pair; the prefill reads why)."""

    @abstractmethod
    def accept(self, pair: Pair, hello: Hello) -> None:
        """Decode, after answering "ok": form the channel and take the tiny transfer."""

    @abstractmethod
    def issue(self, pair: Pair, b: OutBundle, launch: Launch, ready) -> None:
        """Prefill: enqueue one launch of bundle b once `ready` (an event on the
        compute stream, or None)."""

    @abstractmethod
    def seal(self, pair: Pair, b: OutBundle) -> tuple[Completion, int]:
        """Prefill, after the last launch: (the bundle's completion, the doorbell event the
        commit names: same-GPU; else -1)."""

    @abstractmethod
    def post(self, pair: Pair, b: InBundle) -> tuple[Completion, str | None]:
        """Decode: post the whole bundle's receives; (the completion, which covers
        whatever was posted, an error string if posting failed part way, else None)."""

    def commit(self, pair: Pair, b: InBundle, msg: Commit) -> None:
        """Decode: the commit arrived (same-GPU binds the completion event it names)."""

    def kill(self, pair: Pair, bundles: list, then: Callable[[], None]) -> None:
        """Fault injection ("transfer", prefill side): tear the pair's channel down as a failed link
        would, so that the decode side's receives in flight fail now, then `then()` (the pair is
        marked broken and the decode side told). By default the abort, at once."""
        self.abort(pair)
        then()

    @abstractmethod
    def abort(self, pair: Pair) -> None:
        """Tear down the pair's channel so nothing in flight can still complete or write."""

    def release(self, pair: Pair) -> None:
        """The pair is gone for good (its peer restarted, or this transport closed): give back what its
        payload holds (staging memory). Anything still in flight was aborted or ends on its own."""

    def metrics(self) -> dict:
        """Extra entries for the transport's metrics() (torch_dist: staging memory reserved)."""
        return {}

    def followers_part(self, shipment) -> bytes:
        """Prefill, tensor parallelism: what the follower ranks ship with the pass that computes this
        shipment's KV (tp_payload.py); b"" when they ship nothing."""
        return b""

    def mark(self):
        """A CUDA event on the current (compute) stream: the KV enqueued so far is ready then."""
        if not self.kv_cache.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.kv_cache.device))
        return ev

    def _on_stream(self, stream):
        return on_stream(stream, self.kv_cache.device)
