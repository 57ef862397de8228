"""OutBundle: one bundle out, prefill side (sender_side.py sends it; in_bundle.InBundle is its
other end)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from cluster.transport.base import KVSend
from cluster.transport.completion import Completion
from cluster.transport.pair import Pair
from cluster.transport.plan import ItemPlan, Launch


@dataclass(eq=False)
class OutBundle:
    """One bundle out: the transfers one shipment sends one decode peer, their plan and progress."""

    id: int
    pair: Pair
    sends: list[KVSend]
    futures: list[Future]
    items: list[ItemPlan]
    launches: list[Launch]
    issued: int = 0
    payload: Any = None  # the payload's per-bundle state
    completion: Completion | None = None
    commit_event: int = -1
    failed: str | None = None
    t_kv: float = 0.0  # monotonic: the forward finished (the transfer's exposed part starts)
    unlocked: bool = False
    fault: str | None = None  # injected fault this bundle carries ("": none; None: not looked at yet)

    def intact(self) -> bool:
        """This side's payload is done without error: the decode side has every byte."""
        return self.completion is not None and self.completion.done() and self.completion.error() is None
