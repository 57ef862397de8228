"""The FP8 benchmark's dry run (CPU, tiny model): every part runs and writes its rows."""

import json

import pytest


def test_bench_fp8_dry_run(tmp_path):
    from benchmarks import bench_fp8

    foreign = {"source": "bench_decode", "model": "llama-8b-shape", "batch_size": 1, "mode": "graph"}
    (tmp_path / "decode_h200.json").write_text(json.dumps({"rows": [foreign, dict(foreign, source="bench_fp8")]}))
    assert bench_fp8.main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    decode = json.loads((tmp_path / "decode_h200.json").read_text())
    rows = decode["rows"]
    assert rows[0] == foreign  # other benchmarks' rows are kept; this script's earlier rows replaced
    ours = [r for r in rows if r.get("source") == "bench_fp8"]
    assert {(r["weights"], r["kv_cache_dtype"]) for r in ours} == set(bench_fp8.DECODE_VARIANTS)
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in ours)
    # The floor counts what a step reads: FP8 weights are about half of bf16's bytes (float32 on CPU: a quarter
    # of the linears), an FP8 cache a quarter of the float32 cache's.
    by = {(r["weights"], r["kv_cache_dtype"], r["batch_size"]): r["bytes_per_step"] for r in ours}
    assert by[("fp8", "bfloat16", 1)] < by[("bf16", "bfloat16", 1)]
    assert by[("bf16", "fp8", 4)] < by[("bf16", "bfloat16", 4)]
    gemm = decode["bench_fp8"]["gemm"]
    assert {g["path"] for g in gemm} == set(bench_fp8.GEMM_PATHS)
    assert all(g["us"] > 0 and g["kernel"] and g["dispatch"] in bench_fp8.GEMM_PATHS for g in gemm)
    assert all(g["config"]["block_k"] >= 16 for g in gemm if g["path"] in ("fp8_weight_only", "fp8_w8a8_triton"))
    prefill = json.loads((tmp_path / "prefill_h200.json").read_text())["rows"]
    assert prefill and all(r["weights"] == "fp8" and 0 < r["mfu"] for r in prefill)
    quality = json.loads((tmp_path / "fp8_quality.json").read_text())["models"]
    q = quality[0]
    for key in ("fp8_w8a8_vs_bf16", "fp8_weight_only_vs_bf16", "fp8_kv_vs_bf16", "fp8_weights_and_kv_vs_bf16"):
        assert q[key]["positions"] == 80 and 0 <= q[key]["kl_mean"] < 1 and 0.5 < q[key]["top1_agreement"] <= 1
    # The two FP8 weight paths are different math (activations quantized or not): different numbers.
    assert q["fp8_w8a8_vs_bf16"]["kl_mean"] != pytest.approx(q["fp8_weight_only_vs_bf16"]["kl_mean"], rel=1e-6)
    assert q["bf16_kernel_vs_reference_max_abs_logit_error"] == 0  # CPU: the kernels are the references
    errs = json.loads((tmp_path / "fp8_quality.json").read_text())["gemm_error"]
    assert {e["path"] for e in errs} == {"output_rounding", "fp8_weight_only", "fp8_w8a8", "fp8_w8a8_triton"}
    # float32 on CPU: every path within float32 accumulation error of its exact reference
    assert all(0 <= e["rel_fro"] < 1e-5 for e in errs), errs


def test_skipped_parts_keep_their_earlier_results(tmp_path):
    from benchmarks import bench_fp8

    assert bench_fp8.main(["--dry-run", "--out-dir", str(tmp_path), "--skip", "prefill,quality"]) == 0
    first = json.loads((tmp_path / "decode_h200.json").read_text())
    assert bench_fp8.main(["--dry-run", "--out-dir", str(tmp_path), "--skip", "gemm,prefill,quality"]) == 0
    second = json.loads((tmp_path / "decode_h200.json").read_text())
    assert second["bench_fp8"]["gemm"] == first["bench_fp8"]["gemm"]  # decode only: the GEMM rows stay
    assert len([r for r in second["rows"] if r.get("source") == "bench_fp8"]) == len(
        [r for r in first["rows"] if r.get("source") == "bench_fp8"])
