"""The report's arithmetic on CPU, without Locust or a server: windows, percentiles, server joins."""

import json
import random

import pytest

from loadtest.event_table import EventTable, read_events
from loadtest.records import Event, EventWriter, StepWindow, step_windows, timing_rows, token_chunks
from loadtest.report import build_rows, client_row, format_table, percentile, target_checks
from loadtest.server_stats import (RequestRecord, StepRecord, parse_histogram_totals, summarize_records,
                                   summarize_requests, summarize_snapshots)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.2]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_step_windows_drop_warmup_after_ready():
    log = [{"event": "start", "step": 0, "users": 1, "t": 100.0}, {"event": "ready", "step": 0, "users": 1, "t": 100.5},
           {"event": "start", "step": 1, "users": 4, "t": 110.0}, {"event": "ready", "step": 1, "users": 4, "t": 111.0},
           {"event": "end", "t": 120.0}]
    w0, w1 = step_windows(log, warmup_s=2.0)
    assert (w0.users, w0.start, w0.steady_start, w0.end) == (1, 100.0, 102.5, 110.0)
    assert (w1.users, w1.steady_start, w1.end, w1.steady_s) == (4, 113.0, 120.0, 7.0)
    # A step still running ends at `now`, or is left out without it.
    assert len(step_windows(log[:4], 2.0)) == 1 and step_windows(log[:4], 2.0, now=115.0)[1].end == 115.0


def test_rows_join_client_events_and_server_records(tmp_path):
    w = EventWriter(tmp_path / "events-1.csv")
    # Steady window of step 0 is [102, 110): events before 102 are warm-up, stalls count anyway.
    rows = [(101.0, 0, "itl", 500.0), (101.5, 0, "stall", 10000.0)]
    rows += [(102.0 + 0.01 * i, 0, "itl", 10.0 + (i % 3)) for i in range(300)]
    rows += [(103.0, 0, "ttft", 40.0), (105.0, 0, "e2e", 300.0), (105.0, 0, "tokens", 2.0 * 30),
             (105.0, 0, "chunks", 30.0), (105.0, 0, "tpot", 10.5)]
    w.write(rows)
    w.close()
    events = read_events(tmp_path)
    assert events.event(0) == Event(101.0, 0, "itl", 500.0) and len(events) == 307
    log = [{"event": "start", "step": 0, "users": 2, "t": 100.0}, {"event": "end", "t": 110.0}]
    windows = step_windows(log, warmup_s=2.0)
    recs = [StepRecord("d0", 102.0 + 0.01 * i, 2, 4, 2, 10.0, True) for i in range(100)]
    recs += [StepRecord("d0", 101.0, 1, 1, 0, 99.0, True)]  # warm-up: outside the window
    (row,) = build_rows(events, windows, lambda t0, t1: summarize_records([r for r in recs if t0 <= r.t < t1]))
    assert row["batch_size"] == 2 and row["itl_samples"] == 300
    assert row["itl_p50_ms"] == 11.0 and row["itl_max_ms"] == 12.0  # the 500 ms warm-up gap is dropped
    assert row["stalls"] == 1 and row["requests"] == 1 and row["ttft_p50_ms"] == 40.0 and row["tpot_p50_ms"] == 10.5
    assert row["tokens_per_s"] == pytest.approx(301 * 2.0 / 8.0)  # chunks in window * tokens/chunk / steady s
    assert (row["server_batch_size"], row["server_bucket"], row["server_padded_rows"]) == (2, 4, 2)
    assert row["server_step_ms"] == 10.0 and row["itl_p50_over_step"] == 1.1 and row["server_graph_fraction"] == 1.0
    assert "ITL p50" in format_table([row])


def test_a_hand_made_window_gives_its_stated_numbers():
    """ITL 1..100 ms in the steady window [102, 112), in shuffled time order: p50 50.5, p90 90.1, p99
    99.01, max 100, mean 50.5. The window is half-open; stalls and errors count from the step's start."""
    rows = [(102.0 + (v * 37 % 100) / 10, 0, "itl", float(v)) for v in range(1, 101)]
    rows += [(101.99, 0, "itl", 500.0), (112.0, 1, "itl", 1000.0),  # warm-up; the next step
             (102.0, 0, "ttft", 30.0), (105.0, 0, "ttft", 10.0), (111.9, 0, "ttft", 20.0),
             (103.0, 0, "chunk_itl", 4.0), (104.0, 0, "chunk_itl", 2.0),
             (106.0, 0, "e2e", 900.0), (107.0, 0, "e2e", 950.0), (106.0, 0, "tpot", 6.0), (107.0, 0, "tpot", 8.0),
             (106.0, 0, "tokens", 128.0), (106.0, 0, "chunks", 100.0),
             (100.5, 0, "stall", 10000.0), (111.0, 0, "error", 0.0), (112.0, 1, "stall", 10000.0)]
    row = client_row(EventTable.from_rows(rows), StepWindow(0, 16, 100.0, 100.0, 112.0, 102.0))
    assert row == {
        "batch_size": 16, "step": 0, "steady_s": 10.0, "itl_p50_ms": 50.5, "itl_p90_ms": 90.1, "itl_p99_ms": 99.01,
        "itl_max_ms": 100.0, "itl_mean_ms": 50.5, "chunk_itl_p50_ms": 3.0, "chunk_itl_p99_ms": 3.98,
        "tokens_per_chunk": 1.28, "ttft_p50_ms": 20.0, "ttft_p90_ms": 28.0, "ttft_p99_ms": 29.8, "tpot_p50_ms": 7.0,
        "tpot_p99_ms": 7.98, "tokens_per_s": 10.3, "requests": 2, "itl_samples": 100, "stalls": 1, "errors": 1}
    empty = client_row(EventTable.from_rows([]), StepWindow(0, 1, 0.0, 0.0, 10.0, 2.0))
    assert empty["itl_p50_ms"] is None and empty["itl_mean_ms"] is None and empty["tokens_per_s"] == 0.0


def _row_one_event_at_a_time(events: list[Event], w: StepWindow) -> dict:
    """The report's rows as they were computed before the events became columns: a scan of every event
    per window, lists per kind. The reference the columnar rows must equal exactly."""
    steady = [e for e in events if w.steady_start <= e.t < w.end]
    whole = [e for e in events if w.start <= e.t < w.end]
    by: dict[str, list[float]] = {}
    for e in steady:
        by.setdefault(e.kind, []).append(e.value)
    itl, ttft, tpot, chunk_itl = (by.get(k, []) for k in ("itl", "ttft", "tpot", "chunk_itl"))
    tokens, chunks = sum(by.get("tokens", [])), sum(by.get("chunks", []))
    per_chunk = 1.0 if chunk_itl else (tokens / chunks if chunks else 1.0)
    arrived = len(itl) + len(ttft)

    def r(x, nd=3):
        return None if x is None else round(x, nd)
    return {"batch_size": w.users, "step": w.index, "steady_s": round(w.steady_s, 3),
            "itl_p50_ms": r(percentile(itl, 50)), "itl_p90_ms": r(percentile(itl, 90)),
            "itl_p99_ms": r(percentile(itl, 99)), "itl_max_ms": r(max(itl) if itl else None),
            "itl_mean_ms": r(sum(itl) / len(itl) if itl else None), "chunk_itl_p50_ms": r(percentile(chunk_itl, 50)),
            "chunk_itl_p99_ms": r(percentile(chunk_itl, 99)), "tokens_per_chunk": r(tokens / chunks if chunks else None),
            "ttft_p50_ms": r(percentile(ttft, 50)), "ttft_p90_ms": r(percentile(ttft, 90)),
            "ttft_p99_ms": r(percentile(ttft, 99)), "tpot_p50_ms": r(percentile(tpot, 50)),
            "tpot_p99_ms": r(percentile(tpot, 99)),
            "tokens_per_s": r(arrived * per_chunk / w.steady_s if w.steady_s > 0 else None, 2),
            "requests": len(by.get("e2e", [])), "itl_samples": len(itl),
            "stalls": sum(1 for e in whole if e.kind == "stall"), "errors": sum(1 for e in whole if e.kind == "error")}


def test_rows_equal_the_one_event_at_a_time_rows(tmp_path):
    """Streams from three processes over four steps (chunks of 1-3 tokens, so equal ITL values and
    equal times; stalls and errors): read back and summarized per window, every field of every row
    equals what a scan of the events one at a time gives, also for files without chunk_itl rows."""
    rng = random.Random(3)
    log = []
    per_file: dict[str, list] = {"events-7.csv": [], "events-8.csv": [], "events-9.csv": []}
    for step in range(4):
        t_step = 1_767_000_000.0 + 20 * step
        log += [{"event": "start", "step": step, "users": 2 ** step, "t": t_step},
                {"event": "ready", "step": step, "users": 2 ** step, "t": t_step + 0.3}]
        for _ in range(30 * (step + 1)):
            t0 = t_step + rng.uniform(0, 19.5)
            arrival, carried = t0 + rng.uniform(0.01, 0.2), []
            for _ in range(rng.randint(1, 60)):
                carried.append((arrival, rng.choice((1, 1, 2, 3))))
                arrival += rng.choice((0.0105, 0.012, rng.uniform(0.005, 0.05)))
            rows = timing_rows(carried, step, t0, t0)
            last = carried[-1][0]
            n = sum(k for _, k in carried)
            rows += [(last, step, "e2e", (last - t0) * 1000), (last, step, "tokens", float(n)),
                     (last, step, "chunks", float(len(carried)))]
            if n > 1:
                rows.append((last, step, "tpot", (last - carried[0][0]) * 1000 / (n - 1)))
            if rng.random() < 0.05:
                rows.append((last + 1.0, step, rng.choice(("stall", "error")), 0.0))
            per_file[rng.choice(sorted(per_file))].append(rows)
    log.append({"event": "end", "t": 1_767_000_080.0})
    windows = step_windows(log, warmup_s=5.0)
    for drop in ((), ("chunk_itl",)):
        every: list[Event] = []
        for name in sorted(per_file):
            rows = [r for req in per_file[name] for r in req if r[2] not in drop]
            w = EventWriter(tmp_path / name)
            w.write(rows)
            w.close()
            every += [Event(float(f"{t:.6f}"), s, k, float(f"{v:.4f}")) for t, s, k, v in rows]
        every.sort(key=lambda e: e.t)
        table = read_events(tmp_path)
        expected = [_row_one_event_at_a_time(every, w) for w in windows]
        assert [client_row(table, w) for w in windows] == expected
        assert sum(r["itl_samples"] for r in expected) > 5000 and sum(r["stalls"] + r["errors"] for r in expected) > 0
        for name in per_file:
            (tmp_path / name).unlink()


def test_metrics_fallback_differences_histograms():
    def text(n, bs_sum, step_sum, ratio_sum):
        return "\n".join([
            "# TYPE pdserve:decode_batch_size histogram",
            f'pdserve:decode_batch_size_bucket{{le="8.0",model_name="m"}} {n}',
            f'pdserve:decode_batch_size_sum{{model_name="m"}} {bs_sum}',
            f'pdserve:decode_batch_size_count{{model_name="m"}} {n}',
            f'pdserve:decode_step_seconds_sum{{model_name="m"}} {step_sum}',
            f'pdserve:decode_step_seconds_count{{model_name="m"}} {n}',
            f'pdserve:graph_padding_ratio_sum{{model_name="m"}} {ratio_sum}',
            f'pdserve:graph_padding_ratio_count{{model_name="m"}} {n}',
        ])
    a = parse_histogram_totals(text(10, 60.0, 0.1, 2.5))
    assert a["pdserve:decode_batch_size"] == (60.0, 10.0)
    b = parse_histogram_totals(text(110, 660.0, 1.1, 27.5))  # 100 steps of batch 6, 10 ms, 1/4 padded
    s = summarize_snapshots([(1.0, a), (5.0, b), (9.0, b)], 0.5, 6.0)
    assert s["server_source"] == "metrics" and s["server_steps"] == 100
    assert s["server_batch_size"] == 6.0 and s["server_step_ms"] == pytest.approx(10.0)
    assert s["server_padding_ratio"] == 0.25 and s["server_bucket"] == 8.0 and s["server_padded_rows"] == 2.0
    assert summarize_snapshots([(1.0, a)], 0.0, 9.0)["server_batch_size"] is None


def _sse(d: dict) -> bytes:
    return b"data: " + json.dumps(d).encode()


def test_tokens_are_timed_per_token_from_continuous_usage():
    """A chunk's tokens are its usage's growth: TTFT at the first token, one ITL per later token (a
    chunk of k tokens after a gap g gives k of g / k), the raw chunk gaps apart; a token with no text
    (held back by the detokenizer) is a token."""
    lines = [(1.0, _sse({"choices": [{"text": "", "finish_reason": None}], "usage": {"completion_tokens": 1}})),
             (1.010, _sse({"choices": [{"text": "ab", "finish_reason": None}], "usage": {"completion_tokens": 3}})),
             (1.012, _sse({"choices": [{"text": "c", "finish_reason": "length"}], "usage": {"completion_tokens": 4}})),
             (1.013, _sse({"choices": [], "usage": {"completion_tokens": 4}}))]
    carried, n, err = token_chunks(lines)
    assert carried == [(1.0, 1), (1.010, 2), (1.012, 1)] and n == 4 and err is None
    rows = timing_rows(carried, 0, 100.0, 0.5)
    kinds = [k for _, _, k, _ in rows]
    assert kinds.count("ttft") == 1 and kinds.count("itl") == 3 and kinds.count("chunk_itl") == 2
    assert rows[0][3] == pytest.approx(500.0) and rows[0][0] == pytest.approx(100.5)
    assert [v for _, _, k, v in rows if k == "itl"] == pytest.approx([5.0, 5.0, 2.0])
    # Without continuous usage: a chunk with text, or any non-final chunk, is one token.
    plain = [(1.0, _sse({"choices": [{"text": "", "finish_reason": None}]})),
             (1.1, _sse({"choices": [{"text": "", "finish_reason": "stop"}]})),
             (1.2, _sse({"error": {"message": "boom"}}))]
    carried, n, err = token_chunks(plain)
    assert carried == [(1.0, 1)] and n is None and err == "boom"


def test_interval_parts_targets_and_explanations():
    """The server's step intervals next to its steps: medians, the mean parts (which add up), the
    checks, and a row that says which part made the interval or the client's ITL longer."""
    recs = [StepRecord("d0", 10.0 + 0.01 * i, 256, 256, 0, 6.0, True, 9.0 if i % 2 else 8.0,
                       prefill_ms=2.0 if i % 2 else 0.0, idle_ms=0.0, gap_ms=1.0 if i % 2 else 2.0,
                       host_ms=0.5, publish_lag_ms=3.0) for i in range(100)]
    s = summarize_records(recs)
    assert s["server_step_ms"] == 6.0 and s["server_interval_ms"] == 8.5 and s["server_interval_mean_ms"] == 8.5
    parts = s["server_interval_parts_ms"]
    assert parts == {"step": 6.0, "prefill": 1.0, "idle": 0.0, "gap": 1.5}
    assert sum(parts.values()) == pytest.approx(s["server_interval_mean_ms"])
    assert s["server_rows_per_s"] == pytest.approx(256 / 0.006) and s["server_publish_lag_ms"] == 3.0
    row = {"batch_size": 256, "itl_p50_ms": 12.0, "tokens_per_s": 30000.0, **s}
    from loadtest.report import explain

    why = explain(row)
    assert len(why) == 2 and "mostly gap" in why[0] and "publisher held tokens 3.00 ms" in why[1]
    rows = [dict(row, itl_p50_over_step=2.0, interval_over_step=1.42, delivered_over_capacity=0.7),
            {"batch_size": 1, "itl_p50_ms": 2.0, "itl_p50_over_step": 1.05, "interval_over_step": 1.01,
             "delivered_over_capacity": 0.99}]
    c = target_checks(rows)
    assert c["itl_p50_over_step"]["met"] is False and c["itl_p50_over_step"]["per_batch"]["1"] == 1.05
    assert c["interval_over_step"]["met"] is False and c["delivered_over_capacity_at_256"] == {
        "value": 0.7, "target": ">= 0.9", "met": False}
    assert c["itl_bs64_over_bs1"]["met"] is None
    assert target_checks(rows[1:])["interval_over_step"]["met"] is True
    # Requests: the server's own TTFT over the requests whose first token fell in the window.
    reqs = [RequestRecord.from_json({"t": 5.0 + i, "ttft_ms": 20.0 + i, "e2e_ms": 500.0, "output_tokens": 8,
                                     "local_prefill": False, "forward_device_ms": 2.0 + i, "forward_host_ms": 9.0,
                                     "ttft_parts_ms": {"admission": 1.0, "forward": 10.0, "delivery": 9.0 + i}})
            for i in range(5)]
    assert reqs[0].t_first == pytest.approx(5.0 - 0.48)
    assert RequestRecord.from_json({"t": 1.0, "ttft_ms": None, "e2e_ms": 3.0}) is None
    r = summarize_requests(reqs)
    assert r["server_ttft_p50_ms"] == 22.0 and r["server_ttft_parts_p50_ms"] == {
        "admission": 1.0, "forward": 10.0, "delivery": 11.0}
    assert (r["server_forward_device_p50_ms"], r["server_forward_host_p50_ms"]) == (4.0, 9.0)
