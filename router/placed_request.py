"""PlacedRequest: the router's record of an admitted request, and the callbacks that tell its
gateway what happened to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from cluster.wire.messages import GenerateRequest, PrefillResult


@dataclass
class PlacedRequest:
    """The router's record of an admitted request: where it runs and what happened to it.

    `request` is what the workers run (after a migration: prompt + tokens so far, under a new id);
    `origin` is what the client asked for, and `request_id` is always the client's request's id."""

    request: GenerateRequest
    origin: GenerateRequest | None = None
    lost: str | None = None  # set when its worker died: the gateway's next Migrate moves it
    migrations: int = 0
    decode_worker_id: str | None = None
    prefill_worker_id: str | None = None
    local_prefill: bool = False
    prefill_done: bool = False
    cached_tokens: int = 0  # prompt tokens the computing worker found in its prefix cache
    # time.time() points for /stats (router.stats.step_stats.TTFTPoints): admission let it in, the router
    # called its (latest) prefill worker, the placement returned
    admitted_time: float = 0.0
    dispatched_time: float | None = None
    placed_time: float = 0.0
    first_token_time: float | None = None
    prefill_result: PrefillResult | None = None
    # (prefill, decode) pairs whose KV transfer failed this request: it is not placed on them again
    # (its prompt is prefilled on the decode worker, or through another prefill worker).
    avoid_pairs: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self):
        if self.origin is None:
            self.origin = self.request

    @property
    def request_id(self) -> str:
        return self.origin.request_id

    @property
    def worker_request_id(self) -> str:
        return self.request.request_id


# (request, error message): tells the request's gateway that a worker failed it.
Notify = Callable[[PlacedRequest, str], None]
# Tells the request's gateway that its current placement's prompt is computed, or that its prefill
# worker answered with a failure (`cached_tokens` is final: its usage). Never skipped for a placement.
Prefilled = Callable[[PlacedRequest], None]
