"""Placement: which prefill worker computes a prompt and which decode worker generates from it.

Policies are small classes behind two registries, so a deployment picks them by name in its
config (`prefill_policy: least_outstanding_tokens`, `decode_policy: least_loaded`). They rank the
router's `WorkerView`s (polled `WorkerStats` corrected by what the router itself placed and released
since the poll); the router's PlacementWalk (router/requests/placement_walk.py) walks the ranking and falls
back to the next worker when one refuses.

The `prefix_aware` policies also weigh what each worker already caches of the prompt
(router.placement.kv_index, fed by the workers' block events): Dynamo's KV-router trade-off of cache overlap
against load.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from cluster.engine.graph_buckets import padding_fraction
from cluster.wire.messages import GenerateRequest, WorkerStats
from router.placement.kv_index import KVBlockIndex

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._items:
                raise ValueError(f"{self.kind} policy {name!r} is already registered")
            self._items[name] = cls
            return cls
        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def create(self, name: str, **kwargs) -> T:
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} policy {name!r}; choose from {self.names()}")
        return self._items[name](**kwargs)


@dataclass
class InFlight:
    """A placement the worker's last polled stats may not include yet."""

    blocks: int  # KV blocks it takes (decode) or 0 (prefill)
    prefill_tokens: int  # prompt tokens this worker will prefill for it (0: none here)
    acked_at: float | None = None  # time.monotonic() the worker confirmed it; None: the call is still out


@dataclass
class WorkerView:
    """The router's picture of one worker: its last polled stats, corrected by what the router itself
    did since, so that decisions between two polls (a burst arrives in a few ms; polls come every
    0.1 s) see their own effects:

    - `placing`: placements counted from the moment the router decides them, before the worker even
      answers (a burst of concurrent requests must not all pick the worker that looked idle). A poll
      drops those the worker confirmed before that poll was issued: its stats include them.
    - `released`: blocks of requests the router finished here since (their worker frees them; a poll
      issued after the release shows it), so a just-finished request's blocks count as free at once
      and an idle server never refuses a request for stale stats.
    """

    worker_id: str
    role: str
    stats: WorkerStats
    healthy: bool = False  # until the first successful poll
    consecutive_failures: int = 0
    placing: dict[str, InFlight] = field(default_factory=dict)
    released: list[tuple[float, int]] = field(default_factory=list)  # (time.monotonic(), blocks)
    refused: bool = False  # refused a placement since its last poll: not ranked until the next one
    draining: bool = False  # being taken out (a role switch): no new placements
    inflight: set[str] = field(default_factory=set)  # request ids the router has placed here
    placed_total: int = 0  # requests ever placed here: the last tie-break, so idle equals alternate
    restart_seen: str | None = None  # the last new incarnation (a Ray restart) the router counted

    @property
    def placeable(self) -> bool:
        return self.healthy and not self.refused and not self.draining

    @property
    def total_blocks(self) -> int:
        return self.stats.total_blocks

    @property
    def free_blocks(self) -> int:
        taken = sum(p.blocks for p in self.placing.values())
        back = sum(b for _, b in self.released)
        return max(0, min(self.stats.total_blocks, self.stats.free_blocks - taken + back))

    @property
    def running(self) -> int:
        return self.stats.running + self.stats.waiting + len(self.placing)

    @property
    def outstanding_prefill_tokens(self) -> int:
        return self.stats.outstanding_prefill_tokens + sum(p.prefill_tokens for p in self.placing.values())

    # -- the router's own accounting ------------------------------------------------------------
    def begin(self, request_id: str, blocks: int, prefill_tokens: int) -> None:
        """A placement decided here; the call to the worker is about to go out."""
        self.placing[request_id] = InFlight(blocks, prefill_tokens)

    def ack(self, request_id: str, blocks: int | None = None) -> None:
        p = self.placing.get(request_id)
        if p is not None:
            p.acked_at = time.monotonic()
            if blocks is not None:
                p.blocks = blocks

    def rollback(self, request_id: str) -> None:
        """The placement did not happen (refused, failed, cancelled)."""
        self.placing.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The worker is done with what was placed (a prefill finished): nothing left to count."""
        self.placing.pop(request_id, None)

    def release(self, blocks: int) -> None:
        if blocks > 0:
            self.released.append((time.monotonic(), blocks))

    def update(self, stats: WorkerStats, issued_at: float) -> None:
        """A poll issued at `issued_at` (time.monotonic()) answered with `stats`."""
        self.stats = stats
        self.healthy = stats.healthy
        self.consecutive_failures = 0
        self.refused = False
        self.placing = {rid: p for rid, p in self.placing.items() if p.acked_at is None or p.acked_at > issued_at}
        self.released = [(t, b) for t, b in self.released if t > issued_at]


class UsesKVIndex:
    """A policy that ranks by cache overlap: the router binds its index of the workers' cached blocks
    (and only then polls the workers' block events)."""

    def bind_kv_index(self, index: KVBlockIndex) -> None:
        self.kv_index = index

    def overlap_blocks(self, views: list[WorkerView], request: GenerateRequest) -> dict[str, int]:
        """Leading blocks of the prompt each worker holds in its cache, as last reported."""
        index = getattr(self, "kv_index", None)
        if index is None or index.block_size is None:
            return {v.worker_id: 0 for v in views}
        # (The index keeps the prompt's hashes: a request ranked again, or by both policies, hashes once.)
        return index.overlap(index.hashes(request.prompt_token_ids), [v.worker_id for v in views])

    def overlap_tokens(self, views: list[WorkerView], request: GenerateRequest) -> dict[str, int]:
        """Prompt tokens each worker holds in its cache, as last reported (leading whole blocks)."""
        bs = self.kv_index.block_size if getattr(self, "kv_index", None) is not None else None
        return {w: n * (bs or 0) for w, n in self.overlap_blocks(views, request).items()}


# -- prefill ---------------------------------------------------------------------------------------
class PrefillPolicy(ABC):
    @abstractmethod
    def rank(self, views: list[WorkerView], request: GenerateRequest) -> list[WorkerView]:
        """Healthy prefill workers, best first."""


PREFILL_POLICIES: Registry[PrefillPolicy] = Registry("prefill")


@PREFILL_POLICIES.register("least_outstanding_tokens")
class LeastOutstandingTokens(PrefillPolicy):
    """Fewest prompt tokens queued or running: prefill time grows with tokens, not with requests."""

    def rank(self, views, request):
        healthy = [v for v in views if v.placeable]
        return sorted(healthy, key=lambda v: (v.outstanding_prefill_tokens, v.placed_total, v.worker_id))


@PREFILL_POLICIES.register("prefix_aware")
class PrefixAwarePrefill(UsesKVIndex, PrefillPolicy):
    """Fewest prompt tokens to compute before this one is done: the worker's outstanding tokens plus
    the part of this prompt it does not hold in its cache (it computes only that part)."""

    def rank(self, views, request):
        healthy = [v for v in views if v.healthy]
        cached = self.overlap_tokens(healthy, request)
        n = len(request.prompt_token_ids)
        return sorted(healthy, key=lambda v: (v.outstanding_prefill_tokens + n - cached[v.worker_id], v.placed_total,
                                              v.worker_id))


@PREFILL_POLICIES.register("round_robin")
class PrefillRoundRobin(PrefillPolicy):
    def __init__(self):
        self._next = itertools.count()

    def rank(self, views, request):
        healthy = sorted((v for v in views if v.placeable), key=lambda v: v.worker_id)
        if not healthy:
            return []
        k = next(self._next) % len(healthy)
        return healthy[k:] + healthy[:k]


# -- decode ----------------------------------------------------------------------------------------
class DecodePolicy(ABC):
    @abstractmethod
    def rank(self, views: list[WorkerView], request: GenerateRequest, blocks_needed: int) -> list[WorkerView]:
        """Healthy decode workers with room for `blocks_needed` blocks, best first."""


DECODE_POLICIES: Registry[DecodePolicy] = Registry("decode")


@DECODE_POLICIES.register("least_loaded")
class LeastLoadedDecode(DecodePolicy):
    """Load = the larger of KV usage and batch occupancy after placing the request, in coarse steps
    (`load_quantum`), so that near-equal workers tie; the tie goes to the worker whose new batch
    size pads least to its next graph bucket, then to more free blocks, then to the worker that was
    given fewer requests so far (equal idle workers alternate instead of one taking everything).
    Buckets and batch limit are each worker's own (`WorkerStats.graph_buckets`, `max_num_seqs`); the
    padding is cluster.engine.graph_buckets' rule, the one the worker's graph runner pads by."""

    def __init__(self, load_quantum: float = 0.05):
        self.load_quantum = load_quantum

    def load_after(self, v: WorkerView, blocks_needed: int) -> float:
        kv_after = 1.0 - (v.free_blocks - blocks_needed) / max(1, v.total_blocks)
        batch_after = v.running + 1
        return max(kv_after, batch_after / max(1, v.stats.max_num_seqs or batch_after))

    def _key(self, v: WorkerView, blocks_needed: int, cost: float | None = None):
        """cost: what is quantized and compared first (default: the load after placing)."""
        cost = self.load_after(v, blocks_needed) if cost is None else cost
        return (int(cost / self.load_quantum), padding_fraction(v.stats.graph_buckets, v.running + 1), -v.free_blocks,
                v.placed_total, v.worker_id)

    def rank(self, views, request, blocks_needed):
        fits = [v for v in views if v.placeable and v.free_blocks >= blocks_needed]
        return sorted(fits, key=lambda v: self._key(v, blocks_needed))


@DECODE_POLICIES.register("prefix_aware")
class PrefixAwareDecode(UsesKVIndex, LeastLoadedDecode):
    """Cache overlap against load: a worker's cost is its load after placing the request (as
    least_loaded measures it) plus `overlap_weight` x the fraction of the prompt it does not hold
    (what it must receive from a prefill worker, or compute in a local prefill). With the default
    weight a worker that holds the whole prompt wins over one up to half a worker's capacity less
    loaded: sessions stay where their history is cached unless that worker is much busier.
    Ties as in least_loaded."""

    def __init__(self, load_quantum: float = 0.05, overlap_weight: float = 0.5):
        super().__init__(load_quantum)
        self.overlap_weight = overlap_weight

    def rank(self, views, request, blocks_needed):
        healthy = [v for v in views if v.healthy]
        held = self.overlap_blocks(healthy, request)
        # A worker that caches the prompt's leading blocks needs only the rest free (they get pinned).
        fits = [v for v in healthy if v.free_blocks >= blocks_needed - held[v.worker_id]]
        cached = self.overlap_tokens(fits, request)
        n = max(1, len(request.prompt_token_ids))

        return sorted(fits, key=lambda v: self._key(
            v, blocks_needed, self.load_after(v, blocks_needed) + self.overlap_weight * (1 - cached[v.worker_id] / n)))


@DECODE_POLICIES.register("round_robin")
class DecodeRoundRobin(DecodePolicy):
    def __init__(self):
        self._next = itertools.count()

    def rank(self, views, request, blocks_needed):
        fits = sorted((v for v in views if v.placeable and v.free_blocks >= blocks_needed), key=lambda v: v.worker_id)
        if not fits:
            return []
        k = next(self._next) % len(fits)
        return fits[k:] + fits[:k]


# -- a router's pair of policies -------------------------------------------------------------------
@dataclass(frozen=True)
class PlacementPolicies:
    """The prefill and decode policies a router ranks by, created from their config names; those
    that rank by cache overlap are bound to the router's index of the workers' cached blocks."""

    prefill: PrefillPolicy
    decode: DecodePolicy
    indexed_roles: frozenset[str]  # roles whose block events the router polls into the index

    @classmethod
    def create(cls, prefill: str, decode: str, kv_index: KVBlockIndex) -> "PlacementPolicies":
        policies = {"prefill": PREFILL_POLICIES.create(prefill), "decode": DECODE_POLICIES.create(decode)}
        indexed = set()
        for role, policy in policies.items():
            if isinstance(policy, UsesKVIndex):
                policy.bind_kv_index(kv_index)
                indexed.add(role)
        return cls(policies["prefill"], policies["decode"], frozenset(indexed))
