"""bench_prefill's short passes on CPU (--dry-run: a tiny model, the padded pass without capture): the
`mode: "short"` rows carry the issue's fields, and --mode short keeps an existing file's other rows."""

import json


def test_short_rows_merge_into_an_existing_results_file(tmp_path):
    from benchmarks import bench_prefill

    out = tmp_path / "prefill.json"
    mix_row = {"model": "llama-8b-shape", "prompts": 32, "prompt_tokens": 4096, "ms": 89.1, "mfu": 0.81}
    out.write_text(json.dumps({"device": "NVIDIA H200", "matmul_tflops": 792.0, "bench_fp8": {"kept": True},
                               "rows": [mix_row, {"model": "old", "mode": "short", "prompts": 1}], "errors": []}))
    bench_prefill.main(["--dry-run", "--mode", "short", "--reps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] == "NVIDIA H200" and result["bench_fp8"] == {"kept": True}  # the file's fields stay
    assert result["rows"][0] == mix_row and not result["errors"]
    short = [r for r in result["rows"] if r.get("mode") == "short"]
    assert [(r["model"], r["prompts"], r["prompt_len"]) for r in short] == [("tiny-shape", 1, 16), ("tiny-shape", 2, 24)]
    for r in short:
        assert {"model", "prompts", "prompt_len", "wall_ms", "device_ms", "kernels", "eager_wall_ms"} <= set(r)
        assert r["wall_ms"] > 0 and r["device_ms"] > 0
    assert [r["bucket"] for r in short] == [16, 64]  # 16 tokens fill the first bucket; 48 pad to 64
    assert "--mode short" in result["short"]["command"]
    assert result["short"]["graphs"]["tiny-shape"]["buckets"][-1] == bench_prefill.SHORT_MAX_TOKENS
