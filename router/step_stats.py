"""Recent decode steps and request timings, kept at the gateway for `GET /stats`.

The decode workers already send each step's batch size, bucket and step time in their TokenBatch,
so the gateway records them as they pass: load tests join the client's inter-token latency with
what actually ran on the server without asking any worker.
"""

from __future__ import annotations

import time
from collections import deque

from cluster.messages import PrefillResult, TokenBatch


class StepStats:
    def __init__(self, max_steps: int = 50_000, max_requests: int = 10_000):
        self.steps: deque[dict] = deque(maxlen=max_steps)
        self.requests: deque[dict] = deque(maxlen=max_requests)

    def record_batch(self, batch: TokenBatch) -> None:
        if batch.batch_size <= 0:
            return
        self.steps.append({
            "worker_id": batch.worker_id,
            "t": time.time(),
            "step": batch.step,
            "batch_size": batch.batch_size,
            "bucket": batch.bucket,
            "padded_rows": max(0, batch.bucket - batch.batch_size) if batch.bucket else 0,
            "step_ms": batch.step_time_s * 1e3,
            "graph": batch.bucket > 0,
        })

    def record_request(self, request_id: str, arrival: float, placed: float, first_token: float | None,
                       finished: float, tokens: int, result: PrefillResult | None, local_prefill: bool) -> None:
        """TTFT split into queue (admission + prefill queue), prefill, KV transfer and the rest
        (decode worker pick-up of the landed KV and delivery of the first token)."""
        ttft = (first_token - arrival) if first_token else None
        rec = {"request_id": request_id, "t": finished, "ttft_ms": None if ttft is None else ttft * 1e3,
               "e2e_ms": (finished - arrival) * 1e3, "output_tokens": tokens, "local_prefill": local_prefill,
               "queue_ms": None, "prefill_ms": None, "transfer_ms": None, "first_step_ms": None}
        if result is not None and ttft is not None:
            queue = (placed - arrival) + result.queue_s
            rec.update(queue_ms=queue * 1e3, prefill_ms=result.prefill_s * 1e3, transfer_ms=result.transfer_s * 1e3,
                       first_step_ms=max(0.0, ttft - queue - result.prefill_s - result.transfer_s) * 1e3)
        self.requests.append(rec)

    def snapshot(self, since: float = 0.0) -> dict:
        return {
            "now": time.time(),
            "decode_steps": [s for s in self.steps if s["t"] >= since],
            "requests": [r for r in self.requests if r["t"] >= since],
        }
