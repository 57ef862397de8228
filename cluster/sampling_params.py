"""Per-request sampling and stopping parameters (immutable once the request is admitted)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be a number in [0, 100], got {self.temperature!r}", "temperature")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (not isinstance(self.seed, int) or not (0 <= self.seed < 2**63)):
            bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                bad(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_LEN} characters", "stop")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_top_k_top_p(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
