"""PDPlanner: how many workers of each role the cluster should have, from measured rates and the
live request mix. Pure logic (no Ray, no clock of its own): the application layer's PlannerLoop feeds
it observations and carries out its one-worker-at-a-time role changes (deploy/role_switcher.py).

Model (fluid, per second). A prefill worker computes R_p prompt tokens/s (its measured pass rate,
`WorkerStats.prefill_rate`); a decode worker sustains R_d output tokens/s (`decode_capacity`: from
its measured step cost, at the largest batch its batch limit, its KV cache and the TPOT target
allow). The load is lambda requests/s with mean prompt P and mean output O tokens (ArrivalStats).
With n_p prefill and n_d decode workers on N fixed GPUs (n_p + n_d = N), the utilisations are

    u_p = lambda P / (n_p R_p)        u_d = lambda O / (n_d R_d)

and the best split is the one with the smallest bottleneck max(u_p, u_d) (ties: the current split,
then fewer prefill workers). With no prefill worker, decode workers prefill locally: u = u_p + u_d
over all N. Decode workers also absorb prefill when the prefill pool is the slower path (adaptive
placement); the planner leaves that as margin.

It acts only on a clear, lasting gain, so that it never flaps:
- hysteresis: the best split's bottleneck must be below the current one's by `hysteresis`
  (relative), and the current bottleneck above `min_utilization` (an idle cluster is not reshuffled);
- confirmation: the same target `confirmations` observations in a row;
- dwell: `min_dwell_s` since the last change finished; one worker moves per change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import TYPE_CHECKING

from cluster.worker.pass_rate import PassRate
from router.stats.arrival_stats import ArrivalMix

if TYPE_CHECKING:  # annotations only: PlannerConfig stays importable without torch (deploy/config.py)
    from router.placement.placement import WorkerView


@dataclass(frozen=True)
class PlannerConfig:
    min_prefill: int = 0
    min_decode: int = 1
    hysteresis: float = 0.25
    min_utilization: float = 0.3
    confirmations: int = 3
    min_dwell_s: float = 120.0
    tpot_target_s: float = 0.05  # the decode batch a worker may hold is the one whose step meets this


@dataclass(frozen=True)
class PlannerInputs:
    arrival_rate: float  # requests/s
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefill_tokens_per_s: float  # one prefill worker (R_p)
    decode_tokens_per_s: float  # one decode worker (R_d)
    n_prefill: int
    n_decode: int

    @property
    def total(self) -> int:
        return self.n_prefill + self.n_decode


@dataclass(frozen=True)
class RoleChange:
    from_role: str
    to_role: str
    target: tuple[int, int]  # (n_prefill, n_decode) the planner is heading for
    bottleneck_now: float
    bottleneck_target: float


def decode_capacity(step: PassRate, max_num_seqs: int, kv_tokens: int, tokens_per_request: float,
                    tpot_target_s: float) -> float:
    """Output tokens/s one decode worker sustains: b tokens per step(b) seconds at the largest batch
    b its batch limit, its KV (b requests of tokens_per_request each) and the TPOT target allow."""
    b = float(max(1, max_num_seqs))
    if tokens_per_request > 0 and kv_tokens > 0:
        b = min(b, kv_tokens / tokens_per_request)
    if step.unit_s > 0:
        b = min(b, (tpot_target_s - step.overhead_s) / step.unit_s)
    b = max(1.0, b)
    return b / step.seconds(b)


def utilization(inputs: PlannerInputs, n_prefill: int, n_decode: int) -> float:
    """The bottleneck utilisation of a split (math.inf when it cannot serve the load at all)."""
    lam = inputs.arrival_rate
    prefill_work = lam * inputs.mean_prompt_tokens / max(inputs.prefill_tokens_per_s, 1e-9)
    decode_work = lam * inputs.mean_output_tokens / max(inputs.decode_tokens_per_s, 1e-9)
    if n_decode <= 0:
        return math.inf
    if n_prefill <= 0:
        return (prefill_work + decode_work) / n_decode
    return max(prefill_work / n_prefill, decode_work / n_decode)


def best_split(inputs: PlannerInputs, cfg: PlannerConfig) -> tuple[int, int]:
    n = inputs.total
    current = (inputs.n_prefill, inputs.n_decode)
    splits = [(p, n - p) for p in range(cfg.min_prefill, n - cfg.min_decode + 1)]
    if not splits:
        return current
    return min(splits, key=lambda s: (round(utilization(inputs, *s), 9), s != current, s[0]))


def observe(prefill: list[WorkerView], decode: list[WorkerView], mix: ArrivalMix, block_size: int,
            tpot_target_s: float) -> PlannerInputs | None:
    """PlannerInputs from the router's views of its healthy workers; None while a rate is unmeasured."""
    prefill = [v for v in prefill if v.healthy]
    decode = [v for v in decode if v.healthy]
    # Same GPUs, same model: with no prefill worker, the decode workers' local prefill rate stands in.
    p_rates = [v.stats.prefill_rate for v in (prefill or decode) if v.stats.prefill_rate is not None]
    d_rates = [(v.stats.decode_rate, v) for v in decode if v.stats.decode_rate is not None]
    if not p_rates or not d_rates or not decode:
        return None
    per_request = mix.mean_prompt_tokens + mix.mean_output_tokens
    r_p = median(r.units_per_s for r in p_rates)
    r_d = median(decode_capacity(r, v.stats.max_num_seqs, v.stats.total_blocks * block_size, per_request,
                                 tpot_target_s) for r, v in d_rates)
    return PlannerInputs(mix.rate_rps, mix.mean_prompt_tokens, mix.mean_output_tokens, r_p, r_d,
                         len(prefill), len(decode))


@dataclass
class PDPlanner:
    cfg: PlannerConfig = field(default_factory=PlannerConfig)
    last_change_at: float = -math.inf
    _candidate: tuple[int, int] | None = None
    _streak: int = 0
    history: list[tuple[float, tuple[int, int]]] = field(default_factory=list)  # (when, split it moved to)

    def decide(self, now: float, inputs: PlannerInputs | None) -> RoleChange | None:
        """One observation; a role change to make now, or None."""
        if inputs is None or inputs.n_decode < 1:
            self._candidate, self._streak = None, 0
            return None
        current = (inputs.n_prefill, inputs.n_decode)
        target = best_split(inputs, self.cfg)
        u_now, u_target = utilization(inputs, *current), utilization(inputs, *target)
        worth_it = (target != current and u_now > self.cfg.min_utilization
                    and u_target < u_now * (1.0 - self.cfg.hysteresis))
        if not worth_it:
            self._candidate, self._streak = None, 0
            return None
        self._streak = self._streak + 1 if target == self._candidate else 1
        self._candidate = target
        if self._streak < self.cfg.confirmations or now - self.last_change_at < self.cfg.min_dwell_s:
            return None
        more_prefill = target[0] > current[0]
        return RoleChange("decode" if more_prefill else "prefill", "prefill" if more_prefill else "decode",
                          target, u_now, u_target)

    def changed(self, now: float, split: tuple[int, int]) -> None:
        """A role change finished (the dwell time starts now)."""
        self.last_change_at = now
        self._candidate, self._streak = None, 0
        self.history.append((now, split))
