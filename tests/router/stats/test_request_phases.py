"""vLLM's request phases as RouterMetrics observes them: queue ends where the prompt's prefill
started (TTFTPoints.prefill_start), so queue + prefill is exactly each request's TTFT."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.wire.messages import PrefillTimeline
from router.stats.metrics import RouterMetrics
from router.stats.step_stats import TTFTPoints


def _sums(m: RouterMetrics) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(m.render().decode())
            for s in fam.samples if s.name.endswith("_sum")}


def _timeline(forward_start: float) -> PrefillTimeline:
    return PrefillTimeline(submitted=forward_start - 0.001, forward_start=forward_start,
                           forward_done=forward_start + 0.010, first_token_sent=forward_start + 0.011,
                           kv_committed=forward_start + 0.012, pass_host_s=0.010, pass_device_s=0.002, pass_tokens=64)


@pytest.mark.parametrize("placed", [10.005, 10.030], ids=["reserved_first", "reserved_after_the_prefill"])
def test_queue_ends_at_the_prefill_workers_first_pass_whenever_the_reservation_ends(placed):
    """The decode worker's reservation runs beside the prefill: one that ends after the first token
    was drawn (a busy decode worker) must not push the queue past the first token (the phases then
    summed to more than the TTFT: CI run of stop 43)."""
    m = RouterMetrics("m")
    points = TTFTPoints(10.0, 10.001, 10.002, placed, first_token=max(placed, 10.020) + 0.001)
    m.request_finished(points, 10.5, _timeline(10.004))
    s = _sums(m)
    assert s["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.004)
    ttft = points.first_token - points.arrival
    assert s["vllm:request_queue_time_seconds_sum"] + s["vllm:request_prefill_time_seconds_sum"] == pytest.approx(ttft)
    assert s["vllm:request_inference_time_seconds_sum"] == pytest.approx(10.5 - 10.004)


def test_a_local_prefill_starts_once_placed_and_a_lost_answer_at_its_dispatch():
    m = RouterMetrics("m")
    m.request_finished(TTFTPoints(20.0, 20.002, None, 20.003, 20.010), 20.5, None)  # on its decode worker
    assert _sums(m)["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.003)
    m = RouterMetrics("m")
    m.request_finished(TTFTPoints(20.0, 20.002, 20.004, 20.050, 20.040), 20.5, None)  # P's answer lost
    s = _sums(m)
    assert s["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.004)
    assert s["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.036)


def test_a_start_past_the_first_token_is_held_at_it():
    """A migrated request's timeline is its second prefill's, after the client's first token: all queue."""
    m = RouterMetrics("m")
    m.request_finished(TTFTPoints(30.0, 30.001, 30.5, 30.6, 30.1), 31.0, _timeline(30.55))
    s = _sums(m)
    assert s["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.1)
    assert s["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.0)
