"""RequestRecords: each finished request's /stats record and phase metrics, written once its prefill
worker's answer is in.

The router hears that a request finished from its gateway (Finish) and how its prompt went from its
prefill worker's answer (`PrefillResult`, with the worker's timeline: queue, forward, first token).
The two race: the prefill worker answers once the prompt's KV has left, and the decode worker's last
token can reach the client and the gateway's Finish the router first (a request of a few tokens, a
busy router loop, a prefill actor waiting for the GIL). Written at Finish, such a request's record
had no timeline, so its TTFT parts collapsed into `prefill_and_delivery` and the queue/prefill
phases into the dispatch (the router's test_ttft_cases_dry_run saw it on a loaded machine).

So a request that finishes while its placement's answer is still due waits for it: `answered(rs)`
(the router's PrefillDone for that placement, sent whatever the outcome) writes it; `answer_wait_s`
after its finish it is written without one (the answer is lost: its prefill worker died or timed
out). A record carries its own times: one written late sits after records of requests that
finished after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from router.placed_request import PlacedRequest
from router.stats.metrics import RouterMetrics
from router.stats.step_stats import StepStats, TTFTPoints, prefill_timeline

# How long a finished request's record, and its gateway's reply (router/openai/generation.py, settle),
# wait for its placement's prefill answer before going on without it.
ANSWER_WAIT_S = 5.0


@dataclass(frozen=True)
class _Finished:
    rs: PlacedRequest
    points: TTFTPoints
    finished: float  # time.time()
    completion_tokens: int


def answer_due(rs: PlacedRequest) -> bool:
    """Its current placement dispatched the prompt to a prefill worker whose answer has not come."""
    return rs.dispatched_time is not None and not rs.local_prefill and not rs.prefill_done


class RequestRecords:
    """On the router's loop only (its timers are the loop's)."""

    def __init__(self, step_stats: StepStats, metrics: RouterMetrics, answer_wait_s: float = ANSWER_WAIT_S):
        self.step_stats, self.metrics = step_stats, metrics
        self.answer_wait_s = answer_wait_s
        self._due: dict[str, tuple[_Finished, asyncio.TimerHandle]] = {}  # request id -> finish, its timer
        self.written_without_answer = 0  # records whose answer never came within answer_wait_s

    def finished(self, rs: PlacedRequest, points: TTFTPoints, finished: float, completion_tokens: int) -> None:
        """A request its gateway finished (not aborted): recorded now, or when its answer comes."""
        f = _Finished(rs, points, finished, completion_tokens)
        if not answer_due(rs):
            self._write(f)
            return
        earlier = self._take(rs.request_id)  # (never: an id is in flight once at a time)
        if earlier is not None:
            self._write(earlier)
        timer = asyncio.get_running_loop().call_later(self.answer_wait_s, self._expired, rs.request_id)
        self._due[rs.request_id] = (f, timer)

    def answered(self, rs: PlacedRequest) -> None:
        """Its current placement's prefill answer is in (`rs.prefill_result`, or a failure)."""
        f = self._take(rs.request_id)
        if f is not None:
            self._write(f)

    @property
    def waiting(self) -> int:
        return len(self._due)

    def flush(self) -> None:
        """At the router's stop: what still waits is written as it is."""
        for rid in list(self._due):
            self._expired(rid)

    def _expired(self, request_id: str) -> None:
        f = self._take(request_id)
        if f is not None:
            self.written_without_answer += 1
            self.metrics.records_without_prefill_answer.inc()
            self._write(f)

    def _take(self, request_id: str) -> _Finished | None:
        entry = self._due.pop(request_id, None)
        if entry is None:
            return None
        entry[1].cancel()
        return entry[0]

    def _write(self, f: _Finished) -> None:
        rs = f.rs
        self.step_stats.record_request(rs.request_id, f.points, f.finished, f.completion_tokens, rs.prefill_result,
                                       rs.local_prefill)
        self.metrics.request_finished(f.points, f.finished, prefill_timeline(rs.prefill_result, rs.local_prefill))
