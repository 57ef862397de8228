"""bench_disagg's arithmetic on CPU, without a server: goodput per SLO set, 429s apart, the targets."""

import pytest

from benchmarks.bench_disagg import duration_for, evaluate_targets, parse_slos, summarize


def _ok(ttft, tpot, gaps=(0.01, 0.01)):
    return {"ok": True, "status": 200, "ttft": ttft, "tpot": tpot, "gaps": list(gaps)}


def test_goodput_per_slo_set_and_429s_apart():
    results = [_ok(0.2, 0.01), _ok(0.5, 0.01), _ok(0.2, 0.03), _ok(2.0, 0.01),
               {"ok": False, "status": 429}, {"ok": False, "status": "unfinished"}, {"ok": False, "status": 500}]
    loose, tight = parse_slos("loose:1.0:0.05,tight:0.3:0.015")
    row = summarize("adaptive", 8.0, results, 2.0, loose)
    assert row["goodput_rps"] == 1.5  # 3 of 7 meet TTFT <= 1 s and TPOT <= 50 ms, over 2 s
    assert (row["failed"], row["rejected"], row["unfinished"], row["completed"]) == (2, 1, 1, 4)
    assert row["slo"] == "loose" and row["slo_attainment"] == pytest.approx(3 / 7, abs=1e-4)
    assert summarize("adaptive", 8.0, results, 2.0, tight)["goodput_rps"] == 0.5  # only the first
    assert row["itl_p50_ms"] == pytest.approx(10.0) and row["ttft_p50_ms"] == pytest.approx(350.0)


def test_duration_scales_down_with_rate_within_bounds():
    assert duration_for(2, 8, 30, 15) == 15
    assert duration_for(3, 8, 30, 15) == 10
    assert duration_for(48, 8, 30, 15) == 8


def _row(setup, slo, rate, goodput, attainment=1.0, ttft=(100, 150), failed=0, completed=10, requests=10):
    limits = {"loose": (1.0, 0.05), "tight": (0.3, 0.015)}[slo]
    return {"setup": setup, "slo": slo, "request_rate": rate, "goodput_rps": goodput, "slo_attainment": attainment,
            "ttft_p50_ms": ttft[0], "ttft_p99_ms": ttft[1], "failed": failed, "completed": completed,
            "requests": requests, "ttft_slo_s": limits[0], "tpot_slo_s": limits[1]}


def test_targets():
    rows = [
        _row("adaptive", "loose", 2, 2.0, ttft=(100, 250)), _row("colocated", "loose", 2, 2.0),
        _row("adaptive", "loose", 32, 30.0, failed=1, completed=20, requests=40), _row("colocated", "loose", 32, 27.0),
        _row("adaptive", "tight", 2, 2.0), _row("colocated", "tight", 2, 1.9, attainment=0.95),
        _row("adaptive", "tight", 32, 12.0), _row("colocated", "tight", 32, 13.0, attainment=0.4),
    ]
    t = evaluate_targets(rows)
    assert t["goodput_ge_baseline"] == {"tight": {"2": True, "32": False}, "loose": {"2": True, "32": True}}
    assert t["tight_slo_rate"] == 2 and t["tight_slo_goodput_ratio"] == pytest.approx(2.0 / 1.9, abs=1e-3)
    assert t["low_rate_ttft_p99_over_p50"] == 2.5
    assert t["failed_below_saturation"] == 0  # the failure at 32 req/s came with saturation (20 of 40 served)


def test_the_lowest_rate_runs_until_its_request_count():
    from benchmarks.bench_disagg import rate_durations

    d = rate_durations([2, 4, 6, 8, 12, 16, 24, 32, 48], 8, 30, 15, 100)
    assert d[2] == 50  # 100 arrivals expected, past max_duration
    assert d[4] == 8 and d[6] == 8 and d[48] == 8
    assert rate_durations([2, 8], 8, 30, 15, None)[2] == 15


def test_load_shift_goodput_per_phase_and_around_the_switch():
    from benchmarks.bench_disagg import parse_phases, summarize_shift

    phases = parse_phases("prefill_heavy:2:2048:16:10,decode_heavy:4:128/512:256:20")
    assert phases[1] == {"name": "decode_heavy", "rate": 4.0, "prompt_lens": [128, 512], "output_tokens": 256,
                         "seconds": 20.0}
    results = [dict(_ok(0.2, 0.01), phase="prefill_heavy", sent_s=float(t)) for t in range(10)]
    results += [dict(_ok(2.0, 0.01), phase="decode_heavy", sent_s=10.0 + t) for t in range(8)]  # before: too slow
    results += [dict(_ok(0.2, 0.01), phase="decode_heavy", sent_s=18.0 + t) for t in range(12)]  # after the switch
    samples = [{"t_s": 0.0, "role_switches": 0.0, "healthy": {"prefill": 1, "decode": 1}},
               {"t_s": 18.0, "role_switches": 1.0, "healthy": {"decode": 2}}]
    s = summarize_shift("planner", phases, results, samples, parse_slos("loose:1.0:0.05"))
    assert s["first_switch_s"] == 18.0
    before, after = s["around_switch"]
    assert before["when"] == "before" and before["goodput_rps"] == 0.0 and before["requests"] == 8
    assert after["when"] == "after" and after["goodput_rps"] == 1.0 and after["requests"] == 12  # 12 in 12 s
    assert s["healthy_before"] == {"prefill": 1, "decode": 1} and s["healthy_after"] == {"decode": 2}
    assert [p["phase"] for p in s["per_phase"]] == ["prefill_heavy", "decode_heavy"]
    assert len(s["windows"]) == 3 and s["windows"][0]["goodput_rps"] == 1.0
    no_switch = summarize_shift("planner", phases, results, samples[:1], parse_slos("loose:1.0:0.05"))
    assert no_switch["first_switch_s"] is None and "around_switch" not in no_switch
