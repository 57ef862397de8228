"""The report's arithmetic on CPU, without Locust or a server: windows, percentiles, server joins."""

import json

import pytest

from loadtest.make_model import model_config, write_model
from loadtest.records import Event, EventWriter, read_events, step_windows
from loadtest.report import build_rows, format_table, percentile
from loadtest.server_stats import StepRecord, parse_histogram_totals, summarize_records, summarize_snapshots


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
    assert events[0] == Event(101.0, 0, "itl", 500.0)
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


def test_make_model_shapes(tmp_path, demo_model_dir):
    from cluster.engine import LLMEngine
    from cluster.model.config import ModelArchConfig
    from cluster.sampling_params import SamplingParams

    big = ModelArchConfig.from_dict(model_config("llama-1b"))
    assert big.vocab_size == 128256 and big.num_layers == 16 and big.dtype == "bfloat16"
    assert big.weight_count() == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B

    d = write_model("llama-tiny", tmp_path / "m", dtype="float32")
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 4096
    out = LLMEngine(str(d), device="cpu").generate(["Hello"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    demo_vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    assert len(out[0].token_ids) == 6 and max(out[0].token_ids) < demo_vocab  # padded ids are never chosen
