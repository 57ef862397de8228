"""TTFT three ways on a real CPU cluster (the demo model): the Locust report's per-request TTFT (per
token: to the chunk carrying the first token) agrees with the server's own records of the same
requests, and the plain client's with both."""

import json

import pytest

pytestmark = pytest.mark.cluster  # a CPU cluster and Locust in subprocesses


def test_report_ttft_agrees_with_the_servers_own_records(tmp_path, ray_address, monkeypatch):
    from benchmarks import bench_ttft

    monkeypatch.setenv("RAY_ADDRESS", ray_address)  # the cluster it starts (a subprocess) joins the run's Ray

    out = tmp_path / "ttft.json"
    # A 3-s measured window and 2 s of the plain client: at 5 s and 3 s, 45, 31 and 44 requests were
    # counted in one run on a machine half as fast (report, client, server), against the 5, 3 and 5
    # asked for below.
    r = bench_ttft.main(["--start-cluster", "--users", "1", "--step-duration", "4", "--warmup", "1",
                         "--client-seconds", "2", "--prompt-tokens", "32", "--output-tokens", "16", "--out", str(out)])
    assert r == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["report_requests"] >= 5 and row["client_requests"] >= 3 and row["server_requests"] >= 5
    rep, srv, cli = row["report_ttft_p50_ms"], row["server_ttft_p50_ms"], row["client_ttft_p50_ms"]
    # The gateway's arrival -> first token is inside the client's send -> first chunk. How close the
    # three are is the benchmark's to report (its `checks`, met or missed): on a 2-core machine shared
    # with Locust, the client and the cluster, tens of ms of scheduling noise are normal (52 vs 35 ms
    # seen). What the test holds is what a broken definition would break: the report's TTFT is the first
    # token's, not the first visible character's (that mode was a whole request long: ~16 tokens here,
    # hundreds of ms), so all three stay within one TTFT (or 50 ms) of each other.
    assert srv <= rep + 2.0 and rep - srv <= max(srv, 50.0), row
    assert abs(cli - rep) <= max(rep, 50.0), row
    assert set(doc["checks"]) >= {"users1/report_over_server_p50", "users1/report_over_client_p50",
                                  "users1/report_p99_over_p50"}
    assert (tmp_path / "ttft_raw" / "serve.log").is_file()
