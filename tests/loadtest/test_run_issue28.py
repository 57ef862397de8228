"""The one-call GPU script of issue 28, dry (CPU, the demo model): every stage runs, writes its file
flat into the output directory, and the summary puts every target with met / missed in one place."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILES = ("decode_h200.json", "transfer_h200.json", "itl_h200.json", "ttft_h200.json", "prefix_cache_h200.json",
         "issue28_checks.json")


def test_run_issue28_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": os.environ.get("PYTHON", "python"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["bash", str(REPO / "loadtest" / "run_issue28_h200.sh"), str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in FILES:
        assert (out / name).is_file(), (name, r.stdout[-3000:])
    assert all(len(p.relative_to(out).parts) <= 2 for p in out.rglob("*")), "the output is flat"
    decode = json.loads((out / "decode_h200.json").read_text())["rows"]
    committed = json.loads((REPO / "loadtest" / "results" / "decode_h200.json").read_text())["rows"]
    fp8 = [r for r in committed if r.get("source") == "bench_fp8"]
    assert fp8 and [r for r in decode if r.get("source") == "bench_fp8"] == fp8  # bench_fp8's rows kept as they are
    assert any(r.get("source") == "bench_decode" for r in decode)
    itl = json.loads((out / "itl_h200.json").read_text())
    assert [row["batch_size"] for row in itl["rows"]] == [1, 2]
    assert all(row["server_interval_ms"] and row["server_interval_parts_ms"] for row in itl["rows"])
    ttft = json.loads((out / "ttft_h200.json").read_text())["rows"]
    assert [row["users"] for row in ttft] == [1, 2]
    keys = {"users", "report_ttft_p50_ms", "report_ttft_p99_ms", "client_ttft_p50_ms", "client_ttft_p99_ms",
            "server_ttft_p50_ms"}
    assert all(keys <= set(row) and row["client_ttft_p50_ms"] for row in ttft)
    prefix = json.loads((out / "prefix_cache_h200.json").read_text())["rows"]
    assert {row["cache"] for row in prefix} == {"on", "uncached"}
    assert all(row["server_ttft_parts_p50_ms"] for row in prefix)
    checks = json.loads((out / "issue28_checks.json").read_text())
    assert any(k.startswith("itl/") for k in checks) and any(k.startswith("prefix/") for k in checks)
    assert "issue 28 targets" in r.stdout  # the summary comes last
