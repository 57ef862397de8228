"""Recent decode steps and request timings, kept by the router for `GET /stats`.

The decode workers send every step's record (batch size, bucket, step time, the interval since the
previous step and what filled it) to the router's stats sink, and each gateway reports a finished request's client-side timings; the router adds what it
knows (admission, dispatch) and the prefill worker's timeline: each request's TTFT as the parts that
add up to it (TTFTPoints). Load tests join the client's inter-token latency with
what actually ran on the server from these, without asking any worker.

Reads are incremental: every record gets a sequence number, `since(cursor, limit)` returns at most
`limit` records from `cursor` on (pre-encoded JSON, built in the router's process, so a gateway only
forwards bytes) and the cursor to ask from next. The log is bounded (`max_records`); a reader that
fell further behind than that is told how many records it missed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import msgspec

from cluster.wire.messages import PrefillResult, PrefillTimeline
from cluster.wire.stream_messages import DecodeStepRecord

DEFAULT_LIMIT = 5_000
MAX_LIMIT = 20_000


@dataclass(frozen=True)
class TTFTPoints:
    """The router's and gateway's points of one request's way to its first token, time.time() each
    (the prefill worker's come in its PrefillTimeline, on the same clock: one host, one clock)."""

    arrival: float  # the gateway submitted it to the router (parsed, validated, tokenized)
    admitted: float  # admission let it in (after any wait in its queue)
    dispatched: float | None  # the router called its prefill worker (None: prefilled on its decode worker)
    placed: float  # the router's placement returned (a decode worker holds it)
    first_token: float | None  # its first token reached the gateway
    received: float | None = None  # the gateway's HTTP app got it (None: not over HTTP)
    written: float | None = None  # the SSE event carrying its first token went to the socket (None: not streamed)

    @property
    def start(self) -> float:
        """Where the server's TTFT starts: the HTTP app got the request, else its arrival."""
        return self.received if self.received is not None else self.arrival

    @property
    def end(self) -> float | None:
        """Where the server's TTFT ends: its first token's event written, else that token at the gateway."""
        return self.written if self.written is not None and self.first_token is not None else self.first_token

    def prefill_start(self, timeline: PrefillTimeline | None) -> float:
        """Where vLLM's queue phase ends and its prefill phase begins: the prefill worker's first pass
        over the prompt (its timeline), else the dispatch to it (its answer lost), else the
        placement (prefilled on its decode worker, which starts once it holds the request). Never
        before arrival nor after the first token, so queue + prefill = first_token - arrival.
        (Not placed + the worker's queue: the reservation runs beside the prefill, and a slow one
        ends after the first token was drawn.)"""
        if timeline is not None and self.dispatched is not None:
            t = timeline.forward_start
        else:
            t = self.dispatched if self.dispatched is not None else self.placed
        return max(self.arrival, min(t, self.first_token if self.first_token is not None else t))

    def named(self, timeline: PrefillTimeline | None) -> list[tuple[str, float]]:
        """[(part, when it ended)], from ("arrival", arrival) to ("delivery", first_token): each part
        is named after what fills the time up to its point, so the consecutive differences add up
        to the TTFT. With `received` the list starts at ("received", received) and its first part is
        intake (routing, the body's parse and validation, tokenization: up to `arrival`); with
        `written` it ends with write (the first token's SSE event encoded and handed to the socket).
        With the prefill worker's timeline: admission, placement (the router's walk up to
        its call to the prefill worker: the decode worker's reservation is made beside the prefill
        from there on, PlacementWalk), dispatch (the call reaching the prefill worker),
        prefill_queue, forward (every pass over the prompt, the last one complete), sample (its first
        token drawn, the device synced), delivery (that token to the gateway, which reads it only
        once the request is placed: a reservation slower than the prefill shows here, and in the
        record's `placed_ms`). Without (prefilled on the decode worker, or its prefill worker's
        answer lost): admission, placement (the decode worker took it), then the rest as one part."""
        out = [("arrival", self.arrival)] if self.received is None else [("received", self.received),
                                                                          ("intake", self.arrival)]
        out.append(("admission", self.admitted))
        if timeline is not None and self.dispatched is not None:
            out += [("placement", self.dispatched), ("dispatch", timeline.submitted),
                    ("prefill_queue", timeline.forward_start), ("forward", timeline.forward_done),
                    ("sample", timeline.first_token_sent)]
            last = "delivery"
        else:
            out.append(("placement", self.placed))
            last = "local_prefill" if self.dispatched is None else "prefill_and_delivery"
        out.append((last, self.first_token))
        if self.written is not None:
            out.append(("write", self.written))
        return out


def prefill_timeline(result: PrefillResult | None, local_prefill: bool) -> PrefillTimeline | None:
    """The prefill worker's timeline of a request it prefilled (None: prefilled on its decode worker, or
    no answer came)."""
    return result.timeline if result is not None and not local_prefill else None


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
            # Where the interval since the previous step went (cluster.wire.messages.StepTiming), and how long
            # the worker's publisher held the step's tokens.
            "interval_ms": None if r.interval_s is None else r.interval_s * 1e3, "prefill_ms": r.prefill_s * 1e3,
            "idle_ms": r.idle_s * 1e3, "gap_ms": r.gap_s * 1e3, "host_ms": r.host_s * 1e3,
            "publish_lag_ms": r.publish_lag_s * 1e3,
        })

    def record_request(self, request_id: str, points: TTFTPoints, finished: float, tokens: int,
                       result: PrefillResult | None, local_prefill: bool) -> None:
        """The request's TTFT as consecutive parts of its timeline (TTFTPoints.parts: they add up to
        ttft_ms), the timeline itself, and the prefill pass's device and host time."""
        # From the HTTP app's receipt (points.start) to the first token's event written (points.end),
        # where the gateway stamped them: the parts below add up to ttft_ms.
        start, end = points.start, points.end
        ttft = (end - start) if points.first_token else None
        rec = {"request_id": request_id, "t": finished, "ttft_ms": None if ttft is None else ttft * 1e3,
               "e2e_ms": (finished - start) * 1e3, "output_tokens": tokens, "local_prefill": local_prefill,
               "ttft_parts_ms": None, "ttft_points": None, "forward_device_ms": None, "forward_host_ms": None,
               "pass_tokens": None, "transfer_ms": None,
               # arrival -> the router's placement returned (a decode worker holds it); not a part:
               # on the prefill-worker path it runs beside dispatch..sample (TTFTPoints.named)
               "placed_ms": (points.placed - points.arrival) * 1e3}
        timeline = prefill_timeline(result, local_prefill)
        if ttft is not None:
            named = points.named(timeline)
            rec["ttft_points"] = dict(named)
            rec["ttft_parts_ms"] = {name: (t - prev) * 1e3 for (_, prev), (name, t) in zip(named, named[1:])}
        if timeline is not None:
            rec.update(forward_device_ms=timeline.pass_device_s * 1e3, forward_host_ms=timeline.pass_host_s * 1e3,
                       pass_tokens=timeline.pass_tokens, transfer_ms=result.transfer_s * 1e3)
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
