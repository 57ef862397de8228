"""Recent decode steps and request timings, kept by the router for `GET /stats`.

The decode workers send every step's record (batch size, bucket, step time, the interval since the
previous step and what filled it) to the router's stats sink, and each gateway reports a finished request's client-side timings; the router adds what it
knows (placement, prefill and transfer times). Load tests join the client's inter-token latency with
what actually ran on the server from these, without asking any worker.

Reads are incremental: every record gets a sequence number, `since(cursor, limit)` returns at most
`limit` records from `cursor` on (pre-encoded JSON, built in the router's process, so a gateway only
forwards bytes) and the cursor to ask from next. The log is bounded (`max_records`); a reader that
fell further behind than that is told how many records it missed.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from cluster.messages import PrefillResult
from cluster.stream_messages import DecodeStepRecord

DEFAULT_LIMIT = 5_000
MAX_LIMIT = 20_000


class StepStats:
    def __init__(self, max_records: int = 100_000):
        self._log: deque[tuple[int, str, dict]] = deque(maxlen=max_records)  # (seq, kind, record)
        self._next = 0
        self._encode = msgspec.json.Encoder().encode

    @property
    def cursor(self) -> int:
        """The sequence number the next record will get."""
        return self._next

    def _add(self, kind: str, rec: dict) -> None:
        self._log.append((self._next, kind, rec))
        self._next += 1

    def record_step(self, r: DecodeStepRecord) -> None:
        if r.batch_size <= 0:
            return
        self._add("step", {
            "worker_id": r.worker_id, "t": r.t, "step": r.step, "batch_size": r.batch_size, "bucket": r.bucket,
            "padded_rows": max(0, r.bucket - r.batch_size) if r.bucket else 0, "step_ms": r.step_time_s * 1e3,
            "graph": r.bucket > 0,
            # Where the interval since the previous step went (cluster.messages.StepTiming), and how long
            # the worker's publisher held the step's tokens.
            "interval_ms": None if r.interval_s is None else r.interval_s * 1e3, "prefill_ms": r.prefill_s * 1e3,
            "idle_ms": r.idle_s * 1e3, "gap_ms": r.gap_s * 1e3, "host_ms": r.host_s * 1e3,
            "publish_lag_ms": r.publish_lag_s * 1e3,
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
        self._add("request", rec)

    def since(self, cursor: int = 0, limit: int = DEFAULT_LIMIT) -> bytes:
        """JSON {"now", "cursor" (ask from here next), "more" (records after those already wait),
        "missed" (records dropped before the reader got them), "decode_steps": [...], "requests": [...]}
        with at most `limit` records from `cursor`."""
        limit = max(1, min(limit or DEFAULT_LIMIT, MAX_LIMIT))
        oldest = self._log[0][0] if self._log else self._next
        cursor = max(0, min(cursor, self._next))
        missed = max(0, oldest - cursor)
        start = max(cursor, oldest)
        end = min(start + limit, self._next)
        picked = []
        for seq, kind, rec in reversed(self._log):  # readers poll near the end: walk from there
            if seq < start:
                break
            if seq < end:
                picked.append((kind, rec))
        steps, requests = [], []
        for kind, rec in reversed(picked):
            (steps if kind == "step" else requests).append(rec)
        return self._encode({"now": time.time(), "cursor": end, "more": end < self._next, "missed": missed,
                             "decode_steps": steps, "requests": requests})
