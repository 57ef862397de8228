"""bench_gateway's dry run on CPU: one API server (forked from the process template) against the fake
decode worker streams tokens to clients, and the JSON has the row the README's table reads."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_gateway

pytestmark = pytest.mark.slow  # an API-server process, a fake worker and a client process


def test_dry_run_streams_through_one_api_server(tmp_path):
    out = tmp_path / "gateway.json"
    assert bench_gateway.main(["--api-servers", "1", "--streams", "4", "--max-tokens", "16", "--duration", "1.5",
                               "--warmup", "0.5", "--client-procs", "1", "--no-stats-check", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["api_servers"] == 1 and row["events_per_s"] > 0 and row["tokens_per_s"] > 0
    assert row["itl_p50_ms"] is not None and row["itl_p50_ms"] > 0
