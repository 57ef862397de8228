"""The decode benchmark's dry run (CPU, tiny model): every part runs (the launch profile too, which
crashed at HEAD on a sampling kind it was given as SamplingParams), rows carry what the GPU run
reports, other benchmarks' rows survive, and the targets are computed into `checks`."""

import json

import pytest


def test_bench_decode_dry_run(tmp_path):
    from benchmarks import bench_decode

    out = tmp_path / "decode_h200.json"
    fp8 = {"source": "bench_fp8", "model": "llama-8b-shape", "batch_size": 1, "mode": "graph", "weights": "fp8"}
    stale = {"source": "bench_decode", "model": "old", "batch_size": 1, "mode": "graph"}
    out.write_text(json.dumps({"rows": [fp8, stale], "bench_fp8": {"gemm": []}}))
    assert bench_decode.main(["--dry-run", "--out", str(out), "--no-hf"]) == 0
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    assert doc["rows"][0] == fp8 and "bench_fp8" in doc and stale not in doc["rows"]
    ours = [r for r in doc["rows"] if r.get("source") == "bench_decode"]
    modes = {(r["batch_size"], r["mode"]) for r in ours}
    assert modes == {(b, m) for b in (1, 4) for m in ("graph", "eager", "graph-features")}
    for r in ours:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["timed_steps"] >= 2
    feats = [r for r in ours if r["mode"] == "graph-features"]
    assert all(r["bucket"] >= r["batch_size"] and r["features_overhead"] > 0 for r in feats)
    assert set(doc["launches"]) == {f"tiny-shape/bs{b}/{m}" for b in (1, 4) for m in ("graph", "eager")}
    assert {v["variant"] for v in doc["sampler_variants"]} == {"greedy", "sample", "filtered"}
    checks = doc["checks"]
    assert checks["graph_over_eager"]["per_batch"].keys() == {"tiny-shape/bs1", "tiny-shape/bs4"}
    assert checks["llama-8b-shape/bs1/graph_over_floor"]["met"] is None  # not measured in a dry run
    assert all(c["met"] is None for k, c in checks.items() if "over_greedy" in k)  # batch 64 / 256 only
    assert doc["capture"]["tiny-shape"]["graphs"] == 0  # no graphs on CPU


def test_checks_say_met_and_missed():
    from benchmarks.bench_decode import SOURCE, target_checks

    def row(model, bs, mode, step, floor=1.0, gpu=None):
        return {"source": SOURCE, "model": model, "batch_size": bs, "mode": mode, "step_ms": step, "floor_ms": floor,
                "gpu_step_ms": gpu or step}

    rows = [row("llama-8b-shape", 1, "graph", 1.1), row("llama-8b-shape", 1, "eager", 3.0),
            row("llama-8b-shape", 64, "graph", 1.3), row("llama-8b-shape", 64, "eager", 1.2),
            row("llama-8b-shape", 64, "graph-features", 1.5, gpu=1.5),
            {"source": "bench_fp8", "model": "llama-8b-shape", "batch_size": 1, "mode": "graph", "step_ms": 9.0,
             "floor_ms": 1.0}]
    variants = [{"model": "llama-8b-shape", "batch_size": 64, "variant": v, "gpu_step_ms": ms}
                for v, ms in (("greedy", 1.3), ("filtered", 1.35))]
    c = target_checks({"rows": rows, "sampler_variants": variants})
    assert c["llama-8b-shape/bs1/graph_over_floor"] == {"value": 1.1, "target": "<= 1.15", "met": True}
    assert c["llama-8b-shape/bs64/graph_over_floor"]["met"] is False
    assert c["graph_over_eager"]["met"] is False
    assert c["graph_over_eager"]["per_batch"]["llama-8b-shape/bs64"]["value"] == pytest.approx(1.3 / 1.2, abs=1e-4)
    assert c["llama-8b-shape/bs64/filtered_over_greedy"]["met"] is True
    assert c["llama-8b-shape/bs64/features_over_greedy"]["met"] is False  # 1.5 / 1.3 > 1.10
    assert c["llama-8b-shape/bs256/filtered_over_greedy"]["met"] is None
