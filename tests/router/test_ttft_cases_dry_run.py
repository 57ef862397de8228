"""Issue 35's TTFT benchmark on CPU, a dry run against the real prefill/decode cluster (the demo
model): benchmarks.ttft_cases writes rows with exactly the issue's fields, its floor from the server's
own prefill device time and decode step; scripts/ttft_h200.sh (one device call) parses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import ttft_cases, ttft_http


def test_ttft_cases_write_the_issues_rows(real_pd_cluster, tmp_path):
    out = tmp_path / "ttft.json"
    assert ttft_cases.main(["--url", real_pd_cluster.url, "--model-name", "demo", "--vocab-size", "400",
                            "--cases", "1x40,1x64c32", "--levels", "2", "--level-prompt", "24", "--requests", "3",
                            "--output-tokens", "3", "--level-output-tokens", "4", "--seconds", "20",
                            "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["users"], r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(1, 40, 0), (1, 64, 32), (2, 24, 0)]
    # Each case's slowest first tokens, client and server, the server's with their parts.
    assert [(t["users"], t["prompt_tokens"], t["cached_tokens"]) for t in doc["tails"]] == [(1, 40, 0), (1, 64, 32),
                                                                                          (2, 24, 0)]
    for row, tail in zip(rows, doc["tails"]):
        assert tail["client_ttft_slowest_ms"][0] >= row["client_ttft_p99_ms"] - 1e-3, (row, tail)
        assert tail["client_ttft_slowest_ms"] == sorted(tail["client_ttft_slowest_ms"], reverse=True)
        slowest = tail["server_slowest"]
        assert 1 <= len(slowest) <= ttft_cases.TAIL_REQUESTS and slowest[0]["ttft_ms"] >= row["server_ttft_p50_ms"]
        assert all({"intake", "forward", "write"} <= set(s["parts_ms"]) for s in slowest), slowest
        # One client process per case here (at most 16 users each); its CPU over the window, in cores.
        assert len(tail["client_cpu_per_process"]) == 1 and 0 < tail["client_cpu_per_process"][0] < 1.5, tail
        assert 0 <= tail["arrived_in_bursts"] <= 1 and len(tail["prefill_queue_p10_p50_p90_ms"]) == 3, tail
    for r in rows:
        assert tuple(r) == ttft_cases.ROW_FIELDS, r
        assert r["model"] == "demo" and r["client_ttft_p50_ms"] > 0 and r["server_ttft_p50_ms"] > 0, r
        assert r["client_ttft_p99_ms"] >= r["client_ttft_p50_ms"]
        assert r["floor_ms"] == round(r["prefill_device_ms"] + r["decode_step_ms"] + 1.0, 3), r
        assert "forward" in r["server_parts_p50_ms"] and "delivery" in r["server_parts_p50_ms"], r
        # The server's TTFT from the HTTP app's receipt to the first event written (streamed).
        assert {"intake", "write"} <= set(r["server_parts_p50_ms"]), r


def test_ttft_http_splits_each_requests_ttft_into_steps(real_pd_cluster, tmp_path):
    """benchmarks.ttft_http: every client's requests joined with their /stats records; the steps of
    one request add up to its client TTFT, and the server's TTFT is its intake + core + write."""
    out = tmp_path / "http.json"
    assert ttft_http.main(["--url", real_pd_cluster.url, "--requests", "4", "--rounds", "1", "--prompt-tokens", "20",
                           "--vocab-size", "400", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["clients"]) == {"raw", "sse", "httpx", "httpx_inline"}
    for name, s in doc["clients"].items():
        assert s["requests"] == 4 and s["unmatched"] == 0, (name, s)
        assert s["intake_p50"] > 0 and s["write_p50"] > 0 and s["client_send_p50"] > 0, (name, s)
        assert s["client_cpu_ms_per_request"] > 0, (name, s)


def test_ttft_http_steps_add_up_with_and_without_the_http_stamps():
    points = {"received": 10.0, "intake": 10.001, "admission": 10.002, "delivery": 10.010, "write": 10.0104}
    rec = {"ttft_points": points, "ttft_ms": 10.4}
    s = ttft_http.steps(9.9995, 10.011, rec)
    assert sum(s[k] for k in ttft_http.STEPS) == pytest.approx(s["client_ms"]) == pytest.approx(11.5)
    assert (s["client_send"], s["intake"], s["core"], s["write"]) == pytest.approx((0.5, 1.0, 9.0, 0.4))
    old = {"ttft_points": {"arrival": 10.001, "admission": 10.002, "delivery": 10.010}, "ttft_ms": 9.0}
    s = ttft_http.steps(9.9995, 10.011, old)  # a server without the stamps: the client's steps absorb them
    assert (s["client_send"], s["intake"], s["core"], s["write"], s["client_read"]) == pytest.approx((1.5, 0, 9.0, 0, 1.0))


def test_the_device_script_parses():
    script = Path(__file__).parents[2] / "scripts" / "ttft_h200.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
