"""bench_prefill's short passes on CPU (--dry-run: a tiny model, the padded pass without capture): the
`mode: "short"` rows carry the issue's fields, and --mode short keeps an existing file's other rows
(and errors); the rule that says whether a pass's device time came from its events."""

import json


def test_short_rows_merge_into_an_existing_results_file(tmp_path):
    from benchmarks import bench_prefill

    out = tmp_path / "prefill.json"
    mix_row = {"model": "llama-8b-shape", "prompts": 32, "prompt_tokens": 4096, "ms": 89.1, "mfu": 0.81}
    out.write_text(json.dumps({"device": "NVIDIA H200", "matmul_tflops": 792.0, "bench_fp8": {"kept": True},
                               "rows": [mix_row, {"model": "old", "mode": "short", "prompts": 1}],
                               "errors": ["llama-8b-shape 1x4096: OOM", "llama-1b-shape short 1x16: AssertionError()"]}))
    bench_prefill.main(["--dry-run", "--mode", "short", "--reps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] == "NVIDIA H200" and result["bench_fp8"] == {"kept": True}  # the file's fields stay
    # the mixes' errors stay; the old short rows' errors go with their rows
    assert result["rows"][0] == mix_row and result["errors"] == ["llama-8b-shape 1x4096: OOM"]
    short = [r for r in result["rows"] if r.get("mode") == "short"]
    assert [(r["model"], r["prompts"], r["prompt_len"]) for r in short] == [("tiny-shape", 1, 16), ("tiny-shape", 2, 24)]
    for r in short:
        assert {"model", "prompts", "prompt_len", "wall_ms", "device_ms", "kernels", "eager_wall_ms"} <= set(r)
        assert r["wall_ms"] > 0 and r["device_ms"] > 0
    assert [r["bucket"] for r in short] == [16, 64]  # 16 tokens fill the first bucket; 48 pad to 64
    assert "--mode short" in result["short"]["command"] and "commit" in result["short"]
    assert result["short"]["graphs"]["tiny-shape"]["buckets"][-1] == bench_prefill.SHORT_MAX_TOKENS


def test_a_pass_the_gpu_reached_before_its_launches_were_in_is_not_timed_by_its_events():
    """The eager pass waits on the GPU inside: the queued sleep runs out before the host has enqueued it
    all, so its events time host gaps too. That, and not the launch time against the sleep's length
    (185 ms was seen against a 200 ms sleep for such a pass), decides."""
    from benchmarks.bench_prefill import device_timing

    graphed = device_timing([10.9, 11.0, 10.8], [0.0012, 0.0011, 0.0013], [False, False, False])
    assert graphed == {"device_ms": 10.9, "launch_ms": 1.2, "host_sync": False}
    eager = device_timing([15.6, 15.7, 15.5], [0.185, 0.186, 0.184], [True, True, True])
    assert eager["device_ms"] is None and eager["host_sync"] and round(eager["launch_ms"]) == 185
    assert device_timing([1.0, 1.0], [0.001, 0.001], [False, True])["device_ms"] is None  # any rep
