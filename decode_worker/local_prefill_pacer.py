"""LocalPrefillPacer: how much local prefill a decode worker runs between two decode steps while
requests are decoding there, and when. No torch: tested on CPU with made-up rates.

vLLM bounds the prompt tokens a step takes (`max_num_batched_tokens`) so that prefills cost the
decoding requests a bounded stall; here prefill passes run between decode steps, so the bound is
on a pass, tied to the inter-token latency it costs:

- the budget: a pass takes at most the tokens it can compute in about `itl_factor` decode steps (by
  the worker's measured prefill rate, overhead + tokens x per-token, and its latest step time), so
  it adds at most that much to the one interval it falls in; never more than the configured chunk
  cap (`local_prefill_chunk_tokens`), never less than `min(cap, MIN_TOKENS)` (progress when a pass's
  fixed cost alone exceeds a step);
- batching: a pass whose waiting tokens do not fill the budget waits, up to `max_wait_steps` decode
  steps, for more prompts to join it, so that the pass's fixed cost (every weight read once) is paid
  for several prompts instead of one each. A prompt that fills the budget goes at once.

With nothing decoding there is no stall to bound: the whole `max_prefill_tokens` goes, at once.
"""

from __future__ import annotations

import math

from cluster.worker.pass_rate import PassRate

MIN_TOKENS = 32


class LocalPrefillPacer:
    def __init__(self, cap_tokens: int, itl_factor: float = 1.0, max_wait_steps: int = 4):
        self.cap = max(1, cap_tokens)
        self.floor = min(self.cap, MIN_TOKENS)
        self.itl_factor = itl_factor
        self.max_wait_steps = max_wait_steps
        self._held_since: int | None = None  # the decode step at which the waiting prompts were first held
        self.last_budget = self.cap  # what budget() said last (the worker reports it)

    def budget(self, prefill_rate: PassRate | None, step_s: float | None) -> int:
        """Tokens the next pass may take while requests decode."""
        if prefill_rate is None or not step_s or prefill_rate.unit_s <= 0:
            budget = self.cap  # nothing measured yet: the configured cap
        else:
            tokens = (self.itl_factor * step_s - prefill_rate.overhead_s) / prefill_rate.unit_s
            budget = int(max(self.floor, min(self.cap, math.floor(tokens + 1e-6))))  # (float noise)
        self.last_budget = budget
        return budget

    def ready(self, waiting_tokens: int, budget: int, step: int) -> bool:
        """Whether a pass runs now (at decode step `step`) for `waiting_tokens` ready prompt tokens."""
        if waiting_tokens <= 0:
            self._held_since = None
            return False
        if waiting_tokens >= budget:
            self._held_since = None
            return True
        if self._held_since is None:
            self._held_since = step
        if step - self._held_since >= self.max_wait_steps:
            self._held_since = None
            return True
        return False
