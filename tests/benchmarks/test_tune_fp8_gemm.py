"""The FP8 GEMM tuner's dry run (CPU, the kernels under Triton's interpreter): it times every path and
config, drops a config whose output is wrong, and writes a table the kernels can read."""

import json

from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported


def test_tuner_dry_run_writes_a_table_and_drops_wrong_configs(tmp_path, monkeypatch):
    from cluster.kernels import fp8_gemm, fp8_gemm_configs
    from benchmarks import tune_fp8_gemm

    real = fp8_gemm.fp8_gemm

    def broken_when_narrow(x, w, s, bias=None, block=None, locks=None, config=None):
        out = real(x, w, s, bias, block, locks, config)
        return out * 2 if config is not None and config.block_n == 16 else out  # one of the two dry configs

    monkeypatch.setattr(fp8_gemm, "fp8_gemm", broken_when_narrow)
    out, detail = tmp_path / "table.json", tmp_path / "detail.json"
    assert tune_fp8_gemm.main(["--dry-run", "--out", str(out), "--detail", str(detail)]) == 0
    data = json.loads(out.read_text())
    table = fp8_gemm_configs.parse_table(data)  # loads as the kernels would read it
    shapes = list(tune_fp8_gemm.DRY_SHAPES["tiny"].values())
    buckets = {fp8_gemm_configs.m_bucket(m) for m in tune_fp8_gemm.DRY_ROWS}
    assert set(table) == {(n, k, b) for n, k in shapes for b in buckets}
    for e in data["entries"]:
        assert e["path"] in fp8_gemm_configs.PATHS and e["us"][e["path"]] == min(v for v in e["us"].values() if v)
        assert e["weight_only"]["block_n"] == 32  # the broken config never wins
        assert e["weight_TBps"] > 0 and 0 < e["copy_fraction"]
    rows = json.loads(detail.read_text())
    dropped = [r for r in rows if r.get("skipped") == "wrong output"]
    assert dropped and all(r["path"] == "weight_only" and r["config"]["block_n"] == 16 for r in dropped)
    assert any(r["path"] == "w8a8" and "us" in r for r in rows)  # the Triton W8A8 kernel was timed too
