"""benchmarks.ttft_cases.queue_profile: how a case's requests met the prefill worker (the queue part's
spread, and how many arrived in bursts), from the server's own request records."""

from __future__ import annotations

from benchmarks.ttft_cases import queue_profile
from loadtest.server_stats import RequestRecord


def _record(start: float, queue_ms: float, local: bool = False) -> RequestRecord:
    if local:
        parts = {"intake": 0.5, "admission": 0.3, "placement": 0.1, "local_prefill": 5.0, "write": 0.1}
    else:
        parts = {"intake": 0.5, "admission": 0.3, "placement": 0.1, "dispatch": 0.4, "prefill_queue": queue_ms,
                 "forward": 0.7, "sample": 1.5, "delivery": 0.4, "write": 0.1}
    ttft = sum(parts.values())
    return RequestRecord(start + ttft / 1e3, ttft, 50.0, 4, local, parts)


def test_a_burst_waits_for_the_pass_its_first_request_started():
    # Three requests 0.4 ms apart (a burst: the last two wait ~a pass), two alone, one prefilled locally.
    reqs = [_record(10.0, 0.1), _record(10.0004, 2.5), _record(10.0008, 2.3), _record(11.0, 0.2), _record(12.0, 0.1),
            _record(10.0002, 0.0, local=True)]
    got = queue_profile(reqs)
    assert got["arrived_in_bursts"] == 0.6  # 3 of the 5 that met the worker
    p10, p50, p90 = got["prefill_queue_p10_p50_p90_ms"]
    assert p10 == 0.1 and p50 == 0.2 and 2.3 < p90 <= 2.5


def test_spread_arrivals_are_not_a_burst_and_no_records_give_none():
    got = queue_profile([_record(10.0 + i * 0.01, 0.2) for i in range(5)])
    assert got == {"prefill_queue_p10_p50_p90_ms": [0.2, 0.2, 0.2], "arrived_in_bursts": 0.0}
    assert queue_profile([]) == {"prefill_queue_p10_p50_p90_ms": None, "arrived_in_bursts": None}
