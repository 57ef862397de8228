"""PrefillCostModel: what a prompt costs prefilled on a prefill worker (remote) or on its decode
worker (local), from measured rates and the queues the router sees. No CUDA, no I/O: tested on CPU.

Inputs, all measured while serving (and seeded by the workers' warm-up before /ready):
- each worker's fitted pass cost (`WorkerStats.prefill_rate`: seconds = overhead + tokens x
  per-token; the decode worker's local prefill likewise, and `decode_rate` per decode step and row);
- the queues: outstanding prefill tokens as polled plus what the router placed since (`WorkerView`);
- the KV transfer's cost, fitted here from the prefill workers' `PrefillResult` timings;
- the mean output length of recent requests (`ArrivalStats`).

Estimates, in seconds (q = tokens queued ahead, n = the prompt's tokens that path computes: the prompt
less what that worker already caches, when the router's KV index knows it; C = the decode worker's
chunk cap, r = requests decoding there; the transfer moves the prompt less what the decode worker
caches):
    remote(P, n) = q_P x per-token_P (+ overhead_P when q_P > 0)  +  pass_P(n)  +  transfer(n)
    local(D, n)  = pass_D(q_D + n)                                                  when r = 0
                 = (k - 1) x step_D(r) + k x overhead_D + (q_D + n) x per-token_D   when r > 0,
                   with k = ceil((q_D + n) / C) chunks, a decode step between two of them
    itl_cost(D, n) = r x (n x per-token_D + ceil(n / C) x overhead_D) / mean_output x itl_cost_weight
(Both paths then wait for the decode loop's next iteration to publish the first token: left out of
both.)
The ITL cost is the stall the local prefill adds to each running request (spread over its tokens,
so it is what it adds to that request's time per output token) converted into TTFT seconds by
`itl_cost_weight` (a second of TPOT is worth that many seconds of TTFT; 20 is the ratio of the usual
SLOs, 1 s TTFT / 50 ms TPOT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.worker.pass_rate import PassRate, PassRateMeter
from router.placement.placement import WorkerView


@dataclass(frozen=True)
class PrefillEstimate:
    remote_s: float | None  # None: no measured rate for that path yet
    local_s: float | None
    itl_cost_s: float  # TTFT-equivalent cost of local prefill to the decode worker's running requests

    @property
    def local_total_s(self) -> float | None:
        return None if self.local_s is None else self.local_s + self.itl_cost_s


class PrefillCostModel:
    def __init__(self, itl_cost_weight: float = 20.0):
        self.itl_cost_weight = itl_cost_weight
        self.transfer = PassRateMeter(half_life=128)  # (prompt tokens, transfer seconds)

    def observe_transfer(self, prompt_tokens: int, seconds: float) -> None:
        self.transfer.add(prompt_tokens, seconds)

    def transfer_s(self, n: int) -> float:
        rate = self.transfer.rate()
        return rate.seconds(n) if rate is not None else 0.0

    # -- queues ---------------------------------------------------------------------------------
    @staticmethod
    def _drain_s(rate: PassRate, queued: int) -> float:
        return rate.seconds(queued) if queued > 0 else 0.0

    def remote_wait_s(self, p: WorkerView) -> float | None:
        """Seconds before prefill worker `p` starts a prompt placed now (its queue, drained)."""
        rate = p.stats.prefill_rate
        return None if rate is None else self._drain_s(rate, p.outstanding_prefill_tokens)

    def local_s(self, d: WorkerView, n: int) -> float | None:
        """Seconds until decode worker `d` has prefilled its local queue and then these n tokens."""
        rate = d.stats.prefill_rate
        if rate is None:
            return None
        todo = d.outstanding_prefill_tokens + n
        decoding = d.running  # requests placed there that are (or will soon be) decoding
        step = d.stats.decode_rate
        cap = d.stats.local_prefill_chunk_tokens
        if decoding <= 0 or step is None or cap <= 0:
            return rate.seconds(todo)
        chunks = math.ceil(todo / cap)
        return (chunks - 1) * step.seconds(decoding) + chunks * rate.overhead_s + todo * rate.unit_s

    def local_wait_s(self, d: WorkerView) -> float | None:
        """Seconds before decode worker `d` starts a prompt queued locally now."""
        queued = d.outstanding_prefill_tokens
        return 0.0 if queued <= 0 else self.local_s(d, 0)

    def itl_cost_s(self, d: WorkerView, n: int, mean_output_tokens: float) -> float:
        rate = d.stats.prefill_rate
        decoding = d.running
        if rate is None or decoding <= 0:
            return 0.0
        chunks = math.ceil(n / max(1, d.stats.local_prefill_chunk_tokens or n))
        stall = n * rate.unit_s + chunks * rate.overhead_s
        return decoding * stall / max(1.0, mean_output_tokens) * self.itl_cost_weight

    # -- the comparison -------------------------------------------------------------------------
    def estimate(self, n: int, d: WorkerView, p: WorkerView | None, mean_output_tokens: float,
                 cached_on_d: int = 0, cached_on_p: int = 0) -> PrefillEstimate:
        """`cached_on_d` / `cached_on_p`: prompt tokens each worker already holds (its prefix cache, as
        the router's index last saw it): a cached prefix is neither computed again nor moved."""
        remote = None
        local_n = max(1, n - cached_on_d)
        if p is not None and p.stats.prefill_rate is not None:
            remote = (self.remote_wait_s(p) + p.stats.prefill_rate.seconds(max(1, n - cached_on_p))
                      + self.transfer_s(local_n))
        return PrefillEstimate(remote, self.local_s(d, local_n), self.itl_cost_s(d, local_n, mean_output_tokens))

    def best_queue_wait_s(self, prefill: list[WorkerView], decode: list[WorkerView]) -> float:
        """The shortest wait any healthy path offers a new prompt before its prefill starts (0 when a
        path has no measured rate yet: nothing is known to be queued there)."""
        waits = [self.remote_wait_s(p) for p in prefill if p.placeable]
        waits += [self.local_wait_s(d) for d in decode if d.placeable]
        known = [w if w is not None else 0.0 for w in waits]
        return min(known) if known else 0.0
