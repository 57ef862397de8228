"""Issue 35's TTFT benchmark on CPU, a dry run against the real prefill/decode cluster (the demo
model): benchmarks.ttft_cases writes rows with exactly the issue's fields, its floor from the server's
own prefill device time and decode step; scripts/ttft_h200.sh (one device call) parses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks import ttft_cases


def test_ttft_cases_write_the_issues_rows(real_pd_cluster, tmp_path):
    out = tmp_path / "ttft.json"
    assert ttft_cases.main(["--url", real_pd_cluster.url, "--model-name", "demo", "--vocab-size", "400",
                            "--cases", "1x40,1x64c32", "--levels", "2", "--level-prompt", "24", "--requests", "3",
                            "--output-tokens", "3", "--level-output-tokens", "4", "--seconds", "20",
                            "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["users"], r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(1, 40, 0), (1, 64, 32), (2, 24, 0)]
    for r in rows:
        assert tuple(r) == ttft_cases.ROW_FIELDS, r
        assert r["model"] == "demo" and r["client_ttft_p50_ms"] > 0 and r["server_ttft_p50_ms"] > 0, r
        assert r["client_ttft_p99_ms"] >= r["client_ttft_p50_ms"]
        assert r["floor_ms"] == round(r["prefill_device_ms"] + r["decode_step_ms"] + 1.0, 3), r
        assert "forward" in r["server_parts_p50_ms"] and "delivery" in r["server_parts_p50_ms"], r


def test_the_device_script_parses():
    script = Path(__file__).parents[2] / "scripts" / "ttft_h200.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
