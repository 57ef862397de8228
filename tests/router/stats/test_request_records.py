"""RequestRecords: a request that finished before its prefill worker's answer reached the router is
recorded once the answer is in, with the prefill worker's timeline (written at the gateway's Finish,
its TTFT parts collapsed into `prefill_and_delivery`: test_ttft_cases_dry_run on a loaded machine);
a lost answer is recorded without it after the wait; a local prefill and an answered one at once."""

from __future__ import annotations

import asyncio
import json

from cluster.sampling.sampling_params import SamplingParams
from cluster.wire.messages import GenerateRequest, PrefillResult, PrefillTimeline
from router.placed_request import PlacedRequest
from router.stats.metrics import RouterMetrics
from router.stats.request_records import RequestRecords
from router.stats.step_stats import StepStats, TTFTPoints


def _placed(rid: str, *, dispatched: bool = True, local: bool = False) -> PlacedRequest:
    req = GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=3), 0, 10.0)
    rs = PlacedRequest(req, admitted_time=10.001, placed_time=10.003, local_prefill=local, prefill_done=local)
    rs.dispatched_time = 10.002 if dispatched and not local else None
    return rs


def _points(rs: PlacedRequest) -> TTFTPoints:
    return TTFTPoints(10.0, 10.001, rs.dispatched_time, 10.003, 10.020, 9.999, 10.021)


def _answer(rs: PlacedRequest) -> None:
    """What the placement walk does when the prefill worker's answer comes (then PrefillDone)."""
    tl = PrefillTimeline(submitted=10.0025, forward_start=10.004, forward_done=10.014, first_token_sent=10.015,
                         kv_committed=10.016, pass_host_s=0.010, pass_device_s=0.002, pass_tokens=3)
    rs.prefill_result = PrefillResult(rs.request_id, 7, 0.001, 0.010, 0.002, 4096, timeline=tl)
    rs.prefill_done = True


def _records(stats: StepStats) -> dict[str, dict]:
    return {r["request_id"]: r for r in json.loads(stats.since(0))["requests"]}


def test_a_request_that_finished_before_its_answer_is_recorded_with_its_timeline():
    async def main():
        stats = StepStats()
        rec = RequestRecords(stats, RouterMetrics("m"), answer_wait_s=30)
        early, lost, local, answered = (_placed("early"), _placed("lost"), _placed("local", local=True),
                                        _placed("answered"))
        _answer(answered)
        for rs in (early, lost, local, answered):
            rec.finished(rs, _points(rs), 10.5, 3)
        assert set(_records(stats)) == {"local", "answered"} and rec.waiting == 2  # the other two wait
        _answer(early)
        rec.answered(early)
        got = _records(stats)
        assert "forward" in got["early"]["ttft_parts_ms"] and "prefill_and_delivery" not in got["early"]["ttft_parts_ms"]
        assert "forward" in got["answered"]["ttft_parts_ms"]
        assert rec.waiting == 1 and rec.written_without_answer == 0
        rec.flush()  # the router stops: the lost one is written as it is
        got = _records(stats)
        assert "prefill_and_delivery" in got["lost"]["ttft_parts_ms"] and rec.written_without_answer == 1
        assert rec.waiting == 0
        rec.answered(lost)  # too late: nothing written twice
        assert len(json.loads(stats.since(0))["requests"]) == 4
    asyncio.run(main())


def test_a_lost_answer_is_recorded_without_it_after_the_wait():
    async def main():
        stats = StepStats()
        metrics = RouterMetrics("m")
        rec = RequestRecords(stats, metrics, answer_wait_s=0.05)
        rs = _placed("lost")
        rec.finished(rs, _points(rs), 10.5, 3)
        assert _records(stats) == {}
        await asyncio.sleep(0.2)
        assert set(_records(stats)) == {"lost"} and rec.written_without_answer == 1 and rec.waiting == 0
        text = metrics.render()
        assert b"vllm:request_queue_time_seconds_count" in text
        assert b'pdserve:request_records_without_prefill_answer_total{model_name="m"} 1.0' in text
    asyncio.run(main())
