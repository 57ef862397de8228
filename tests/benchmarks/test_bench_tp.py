"""The TP benchmark's dry run (CPU, gloo, the tiny shape): the decode rows of TP 1 and TP 2 and the
all-reduce rows, each with its numbers; rows of another bench already in the file are kept."""

import json


def test_bench_tp_dry_run(tmp_path):
    from benchmarks import bench_tp

    out = tmp_path / "tp.json"
    out.write_text(json.dumps({"rows": [{"bench": "pairs", "pair": "1x2", "exact": True}]}))
    assert bench_tp.main(["decode", "allreduce", "--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {"bench": "pairs", "pair": "1x2", "exact": True} in rows
    decode = [r for r in rows if r["bench"] == "decode"]
    assert {(r["tp"], r["batch_size"]) for r in decode} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and r["ratio"] > 0 for r in decode)
    # A rank reads about half of the TP-1 weights (the norms are replicated).
    b1 = next(r for r in decode if (r["tp"], r["batch_size"]) == (1, 1))["bytes_per_rank"]
    b2 = next(r for r in decode if (r["tp"], r["batch_size"]) == (2, 1))["bytes_per_rank"]
    assert 0.45 < b2 / b1 < 0.6
    ar = [r for r in rows if r["bench"] == "allreduce"]
    assert ar and all(r["correct"] and r["path"] == "gloo" and r["us"] > 0 for r in ar)
