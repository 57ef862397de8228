"""issue28_summary: a stage that ran but wrote nothing is reported not measured (and missed); a stage
skipped on purpose is not."""

from __future__ import annotations

import json

from loadtest.issue28_summary import collect, main


def test_a_stage_without_results_is_not_measured(tmp_path):
    (tmp_path / "decode_h200.json").write_text(json.dumps({"rows": [], "checks": {"b1": {"met": True}}}))
    checks, lines = collect(tmp_path, frozenset({"transfer", "prefix"}))
    assert checks["decode/b1"] == {"met": True}
    assert checks["itl/measured"]["met"] is False and "itl_h200.json" in checks["itl/measured"]["detail"]
    assert "ttft/measured" in checks
    assert not any(k.startswith(("transfer/", "prefix/", "decode/measured")) for k in checks)
    assert any("itl: NOT MEASURED" in x for x in lines)


def test_main_writes_the_checks_file(tmp_path, capsys):
    assert main([str(tmp_path), "--skip", "decode,transfer,prefix,ttft"]) == 0
    checks = json.loads((tmp_path / "issue28_checks.json").read_text())
    assert list(checks) == ["itl/measured"]
    assert "MISSED itl/measured" in capsys.readouterr().out
