"""InBundle: one bundle in, decode side (receiver_side.py takes it in; out_bundle.OutBundle is its
other end), and the expected transfers it lands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.wire.messages import Reservation
from cluster.transport.completion import Completion
from cluster.transport.pair import Pair
from cluster.transport.plan import ItemPlan, Launch


@dataclass(eq=False)
class Expected:
    """A transfer the decode worker reserved blocks for (`expect`), until a Begin takes it in or its
    deadline, a cancel or its peer's death fails it."""

    reservation: Reservation
    peer: str
    deadline: float  # monotonic
    state: str = "waiting"  # -> "claimed" (the deadline passed but the prefill had claimed it)
    cancel: bool = False


@dataclass(eq=False)
class InBundle:
    """One bundle in: the transfers a Begin announced, their plan, and what the Commit brought."""

    id: int
    pair: Pair
    expects: list[Expected]
    num_tokens: list[int]
    items: list[ItemPlan]
    launches: list[Launch]
    t_begin: float  # monotonic
    completion: Completion | None = None
    committed: bool = False
    tokens: list[int] = field(default_factory=list)
    oks: list[bool] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per item: PrefillLogprobs or None (empty: none asked)
    failed: str | None = None
    payload: Any = None  # the payload's per-bundle state

    def intact(self) -> bool:
        """Every byte landed without error, and the first tokens came too."""
        return (self.completion is not None and self.completion.done() and self.completion.error() is None
                and self.committed)
