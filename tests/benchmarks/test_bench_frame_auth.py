"""bench_frame_auth's dry run (a few iterations) on CPU: it runs and writes its JSON."""

from __future__ import annotations

import json

from benchmarks import bench_frame_auth


def test_dry_run_writes_its_json(tmp_path):
    out = tmp_path / "frame_auth.json"
    assert bench_frame_auth.main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["frame"] for r in rows] == ["token_stream_1", "token_stream_8", "token_stream_64", "token_stream_256",
                                          "kv_control_begin"]
    assert all(r["sign_us"] > 0 and r["verify_us"] > 0 and r["decode_us"] > 0 for r in rows)
