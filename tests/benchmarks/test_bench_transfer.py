"""The transfer bench's dry run (CPU, gloo, two processes): it times the served path's order (claim,
KV ready, the compute stream's sync, commit, the payload's future) and the decode side's arrival, and
every row is exact."""


def test_bench_transfer_dry_run_times_what_the_served_path_pays(tmp_path):
    from benchmarks import bench_transfer

    doc = bench_transfer.main(["--dry-run", "--out", str(tmp_path)])
    assert (tmp_path / "transfer_h200.json").is_file()
    rows = doc["rows"]
    assert [r["prompt_tokens"] for r in rows] == [32, 256]
    for r in rows:
        assert r["exact"] and r["reps"] >= 2
        # What TTFT pays (prefill done -> arrival) includes the commit -> arrival part, and the served
        # path's own record (prefill done -> the prefill side's future) is part of the same span.
        assert 0 < r["commit_to_arrival_s"] <= r["seconds"] + 1e-3
        assert 0 <= r["served_transfer_s"] and r["kv_ready_to_arrival_s"] > 0 and r["GBps"] > 0
