"""bench_store's dry run on CPU (gloo): it runs, writes its JSON, and every key the pair's rendezvous
wrote is one the warden keeps (the GPU run checks the same for NCCL)."""

from __future__ import annotations

import json

from benchmarks import bench_store


def test_dry_run_writes_its_json_and_the_warden_keeps_the_pairs_keys(tmp_path):
    out = tmp_path / "store.json"
    assert bench_store.main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["start"]["cpu_s_median"] > 0 and result["sweep"]["wall_us_per_key"] > 0
    pair = result["pair"]
    assert pair["ok"] and pair["warden"]["sweeps"] > 0
    assert [k["key"] for k in pair["keys"]] == ["bench-pair/pg/p.1/d.1/g0/L0/0/0", "bench-pair/pg/p.1/d.1/g0/L0/0/1"]
