"""loadtest_reader's dry run (~1 MB of synthetic events) on CPU: it writes its JSON, one row per level,
and the same seed gives the same files and rows (what compares two readers)."""

from __future__ import annotations

import json

from benchmarks import loadtest_reader


def test_dry_run_writes_its_json(tmp_path):
    out = tmp_path / "reader.json"
    assert loadtest_reader.main(["--dry-run", "--dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["files"] == 8 and result["events"] > 10_000 and result["total_s"] > 0
    assert [r["batch_size"] for r in result["rows"]] == list(loadtest_reader.LEVELS)
    assert all(r["itl_samples"] > 0 for r in result["rows"])
    torn = (tmp_path / "run" / "events-1007.csv").read_bytes()
    assert not torn.endswith(b"\n")  # the killed process's last line
    again = tmp_path / "again.json"
    assert loadtest_reader.main(["--dry-run", "--dir", str(tmp_path / "run2"), "--out", str(again)]) == 0
    assert json.loads(again.read_text())["rows_sha256"] == result["rows_sha256"]
    reuse = tmp_path / "reuse.json"
    assert loadtest_reader.main(["--dir", str(tmp_path / "run"), "--reuse", "--out", str(reuse)]) == 0
    assert json.loads(reuse.read_text())["events"] == result["events"]
