"""Where a prompt is prefilled: on a prefill worker (remote; its KV then moves to the decode worker)
or on the decode worker chosen for it (local, in chunks between its decode steps).

Two modes, picked by `prefill_placement` in the config:
- `static`: local when the prompt has at most `local_prefill_threshold` tokens (or no prefill worker
  is healthy); otherwise remote. Conditional disaggregation with a fixed threshold.
- `adaptive` (the default): local when the prompt is that short, when no prefill worker is
  healthy, or when the PrefillCostModel says local is cheaper: the prefill pool's expected wait plus
  the prompt's own prefill and transfer exceeds the local cost (the decode worker's local queue and
  the prompt, paced by its chunk cap, plus the stall it adds to the requests decoding there). Each
  path counts only the tokens it computes (a prefix either worker caches, as the router's KV index
  knows, is neither computed nor moved). A path with no measured rate yet is not chosen over one
  with a rate; with neither, remote.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from router.placement.placement import Registry, WorkerView
from router.placement.prefill_cost_model import PrefillCostModel, PrefillEstimate


@dataclass(frozen=True)
class PrefillChoice:
    local: bool
    prefill: WorkerView | None  # the prefill worker (remote), None when local
    reason: str  # "short" | "no_prefill_worker" | "cheaper_local" | "cheaper_remote" | "unmeasured"
    estimate: PrefillEstimate | None = None


class LocalPrefillPolicy(ABC):
    def __init__(self, threshold: int = 0):
        self.threshold = threshold

    def choose(self, prompt_len: int, d: WorkerView, prefill_ranked: list[WorkerView], cost: PrefillCostModel,
               mean_output_tokens: float, cached: dict[str, int] | None = None) -> PrefillChoice:
        """`cached`: prompt tokens each worker holds in its prefix cache (worker id -> tokens), where
        the router's KV index knows it."""
        if not prefill_ranked:
            return PrefillChoice(True, None, "no_prefill_worker")
        if prompt_len <= self.threshold:
            return PrefillChoice(True, None, "short")
        return self._choose(prompt_len, d, prefill_ranked, cost, mean_output_tokens, cached or {})

    @abstractmethod
    def _choose(self, prompt_len: int, d: WorkerView, prefill_ranked: list[WorkerView], cost: PrefillCostModel,
                mean_output_tokens: float, cached: dict[str, int]) -> PrefillChoice:
        """Above the threshold, with at least one healthy prefill worker."""


LOCAL_PREFILL_POLICIES: Registry[LocalPrefillPolicy] = Registry("prefill placement")


@LOCAL_PREFILL_POLICIES.register("static")
class StaticThreshold(LocalPrefillPolicy):
    def _choose(self, prompt_len, d, prefill_ranked, cost, mean_output_tokens, cached):
        return PrefillChoice(False, prefill_ranked[0], "above_threshold")


@LOCAL_PREFILL_POLICIES.register("adaptive")
class AdaptivePrefill(LocalPrefillPolicy):
    def _choose(self, prompt_len, d, prefill_ranked, cost, mean_output_tokens, cached):
        # The ranking already puts the prefill worker with the shortest queue first.
        p = prefill_ranked[0]
        est = cost.estimate(prompt_len, d, p, mean_output_tokens, cached.get(d.worker_id, 0), cached.get(p.worker_id, 0))
        local = est.local_total_s
        if est.remote_s is None or local is None:
            # Unmeasured on one side: take the measured side if it is the local one, else remote.
            if est.remote_s is None and local is not None:
                return PrefillChoice(True, None, "unmeasured", est)
            return PrefillChoice(False, p, "unmeasured", est)
        if local < est.remote_s:
            return PrefillChoice(True, None, "cheaper_local", est)
        return PrefillChoice(False, p, "cheaper_remote", est)
