"""StepStats, what `GET /stats` answers from: incremental by cursor, bounded per answer and in all."""

from __future__ import annotations

import json

from cluster.wire.stream_messages import DecodeStepRecord
import pytest

from cluster.wire.messages import PrefillResult, PrefillTimeline
from router.stats.step_stats import MAX_LIMIT, StepStats, TTFTPoints


def _step(i: int, bs: int = 4) -> DecodeStepRecord:
    return DecodeStepRecord("decode-0", i, 1000.0 + i, bs, 8, 0.002)


def test_cursor_returns_each_record_once_in_order():
    st = StepStats()
    for i in range(10):
        st.record_step(_step(i))
    st.record_step(_step(99, bs=0))  # an idle step is no decode work: not recorded
    st.record_request("r", TTFTPoints(1.0, 1.05, None, 1.1, 1.2), 2.0, 5, None, True)
    seen, cursor = [], 0
    while True:
        body = json.loads(st.since(cursor, 3))
        seen += [s["step"] for s in body["decode_steps"]] + [r["request_id"] for r in body["requests"]]
        assert len(body["decode_steps"]) + len(body["requests"]) <= 3 and body["missed"] == 0
        cursor = body["cursor"]
        if not body["more"]:
            break
    assert seen == list(range(10)) + ["r"] and cursor == st.cursor == 11
    s = json.loads(st.since(0, 1))["decode_steps"][0]
    assert s == {"worker_id": "decode-0", "t": 1000.0, "step": 0, "batch_size": 4, "bucket": 8, "padded_rows": 4,
                 "step_ms": 2.0, "graph": True, "interval_ms": None, "prefill_ms": 0.0, "idle_ms": 0.0, "gap_ms": 0.0,
                 "host_ms": 0.0, "publish_lag_ms": 0.0}
    st.record_step(DecodeStepRecord("decode-0", 1, 1001.0, 4, 8, 0.002, 0.003, 0.0005, 0.0, 0.0005, 0.0002, 0.001))
    s = json.loads(st.since(st.cursor - 1, 1))["decode_steps"][0]
    assert (s["interval_ms"], s["prefill_ms"], s["gap_ms"], s["publish_lag_ms"]) == (3.0, 0.5, 0.5, 1.0)


def test_bounded_log_reports_what_a_slow_reader_missed():
    st = StepStats(max_records=100)
    for i in range(250):
        st.record_step(_step(i))
    body = json.loads(st.since(0, 10))
    assert body["missed"] == 150 and [s["step"] for s in body["decode_steps"]] == list(range(150, 160))
    body = json.loads(st.since(240, 0))  # 0: the default limit
    assert body["missed"] == 0 and len(body["decode_steps"]) == 10 and not body["more"]
    assert json.loads(st.since(10**9))["cursor"] == 250  # a cursor from the future is clamped


def test_answers_are_bounded_in_size():
    st = StepStats(max_records=50_000)
    for i in range(30_000):
        st.record_step(_step(i))
    body = json.loads(st.since(0, 10**9))
    assert len(body["decode_steps"]) == MAX_LIMIT and body["more"] and body["cursor"] == MAX_LIMIT


def test_a_request_ttft_is_its_timeline_parts_in_order():
    """A prompt prefilled on a prefill worker: its TTFT is the differences of its points, gateway ->
    router -> prefill worker -> gateway, named after what filled them; they add up to ttft_ms."""
    st = StepStats()
    tl = PrefillTimeline(submitted=10.004, forward_start=10.006, forward_done=10.016, first_token_sent=10.017,
                         kv_committed=10.0175, pass_host_s=0.010, pass_device_s=0.002, pass_tokens=128)
    result = PrefillResult("r", 7, 0.002, 0.011, 0.0004, 4096, timeline=tl)
    st.record_request("r", TTFTPoints(10.0, 10.001, 10.003, 10.0031, 10.018), 10.5, 9, result, False)
    # Prefilled on the decode worker (or no prefill answer): admission, placement, the rest as one.
    st.record_request("l", TTFTPoints(20.0, 20.002, None, 20.003, 20.010), 20.5, 9, None, True)
    remote, local = json.loads(st.since(0))["requests"]
    parts = remote["ttft_parts_ms"]
    assert list(parts) == ["admission", "placement", "dispatch", "prefill_queue", "forward", "sample", "delivery"]
    assert parts["forward"] == pytest.approx(10.0) and parts["delivery"] == pytest.approx(1.0)
    assert sum(parts.values()) == pytest.approx(remote["ttft_ms"]) and remote["ttft_ms"] == pytest.approx(18.0)
    points = list(remote["ttft_points"].values())
    assert points == sorted(points) and points[0] == 10.0 and points[-1] == 10.018
    assert (remote["forward_device_ms"], remote["forward_host_ms"], remote["pass_tokens"]) == (2.0, 10.0, 128)
    assert remote["transfer_ms"] == pytest.approx(0.4)
    assert remote["placed_ms"] == pytest.approx(3.1)  # the reservation, beside the prefill: not a part
    assert list(local["ttft_parts_ms"]) == ["admission", "placement", "local_prefill"]
    assert sum(local["ttft_parts_ms"].values()) == pytest.approx(local["ttft_ms"]) == pytest.approx(10.0)
    assert local["forward_device_ms"] is None


def test_a_request_over_http_counts_its_intake_and_its_first_event_written():
    """Stamped by the gateway's HTTP app: `received` (before routing, parse, validation and
    tokenization) starts the TTFT, the first token's event written (`written`) ends it; the parts
    still add up to ttft_ms, and e2e_ms counts from `received` too."""
    st = StepStats()
    tl = PrefillTimeline(submitted=10.004, forward_start=10.006, forward_done=10.016, first_token_sent=10.017,
                         kv_committed=10.0175, pass_host_s=0.010, pass_device_s=0.002, pass_tokens=128)
    result = PrefillResult("r", 7, 0.002, 0.011, 0.0004, 4096, timeline=tl)
    st.record_request("r", TTFTPoints(10.0, 10.001, 10.003, 10.0031, 10.018, received=9.9988, written=10.0184),
                      10.5, 9, result, False)
    # Not streamed (no event written): from `received` to the first token at the gateway.
    st.record_request("l", TTFTPoints(20.0, 20.002, None, 20.003, 20.010, received=19.999), 20.5, 9, None, True)
    remote, local = json.loads(st.since(0))["requests"]
    parts = remote["ttft_parts_ms"]
    assert list(parts) == ["intake", "admission", "placement", "dispatch", "prefill_queue", "forward", "sample",
                           "delivery", "write"]
    assert parts["intake"] == pytest.approx(1.2) and parts["write"] == pytest.approx(0.4)
    assert sum(parts.values()) == pytest.approx(remote["ttft_ms"]) and remote["ttft_ms"] == pytest.approx(19.6)
    assert remote["e2e_ms"] == pytest.approx(501.2) and remote["placed_ms"] == pytest.approx(3.1)
    assert list(remote["ttft_points"])[0] == "received" and remote["ttft_points"]["write"] == 10.0184
    assert list(local["ttft_parts_ms"]) == ["intake", "admission", "placement", "local_prefill"]
    assert sum(local["ttft_parts_ms"].values()) == pytest.approx(local["ttft_ms"]) == pytest.approx(11.0)
