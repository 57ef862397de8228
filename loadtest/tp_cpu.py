"""Issue 26's CPU results (loadtest/results/tp_cpu.json): one row {case, ok, detail} per case the issue
names, each made by running the suite's tests of that case (gloo, the torch reference path) and
recording how they ended. Nothing here decides an outcome: `ok` is whether every test of the case
passed, `detail` names the tests, their outcomes and times (the first failure's last line if any).

    flock /tmp/pdserve-heavy.lock python -m loadtest.tp_cpu --out loadtest/results/tp_cpu.json
    python -m loadtest.tp_cpu --check      # only collect: every case's tests exist (no run)

The tests start processes and Ray clusters: run under the heavy-run lock (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ENGINE = "tests/cluster/test_engine_tp.py::test_greedy_tp2_equals_tp1_and_hf_generate"
_TRANSFER = "tests/cluster/transport/test_tp_transfer.py::test_tp_transfer_is_exact"
_SERVING = "tests/reliability/test_tp_serving.py"

# case -> the tests that decide it (pytest node ids, relative to the repository root).
CASES: dict[str, list[str]] = {
    "greedy_tp2_eq_tp1_eq_hf_llama_gqa": [f"{_ENGINE}[demo_model_dir]"],
    "greedy_tp2_eq_tp1_eq_hf_qwen2_bias": [f"{_ENGINE}[qwen2_model_dir]"],
    "greedy_tp2_eq_tp1_eq_hf_mistral": [f"{_ENGINE}[mistral_model_dir]"],
    "kv_transfer_exact_p1_d2": [f"{_TRANSFER}[demo-P1D2]"],
    "kv_transfer_exact_p2_d1": [f"{_TRANSFER}[demo-P2D1]", f"{_TRANSFER}[mistral-P2D1]"],
    "kv_transfer_exact_p2_d2": [f"{_TRANSFER}[demo-P2D2]"],
    "placement_of_tp_ranks": ["tests/deploy/test_tp_placement.py::test_ranks_share_a_node_and_a_bundle_with_a_gpu_each",
                              f"{_SERVING}::test_tp2_prefill_and_decode_workers_serve_exactly"],
    "rank_killed_mid_stream_migrates_exact_no_hang_group_restarts": [
        "tests/cluster/distributed/test_watchdog.py::test_a_killed_follower_takes_the_group_down",
        "tests/cluster/distributed/test_watchdog.py::test_a_killed_rank0_takes_the_followers_down",
        f"{_SERVING}::test_a_killed_follower_restarts_the_group_and_its_requests_migrate_exactly"],
}


class _Outcomes:
    """A pytest plugin: per node id, (outcome, seconds, last line of the failure)."""

    def __init__(self):
        self.by_id: dict[str, tuple[str, float, str]] = {}
        self.collected: list[str] = []

    def pytest_collection_modifyitems(self, items):
        self.collected = [i.nodeid for i in items]

    def pytest_runtest_logreport(self, report):
        # One report per phase (setup, call, teardown): the first that is not a pass decides.
        outcome, secs, why = self.by_id.get(report.nodeid, ("passed", 0.0, ""))
        if outcome == "passed" and report.failed:
            lines = str(report.longrepr).strip().splitlines()
            outcome, why = ("failed" if report.when == "call" else "error"), (lines[-1] if lines else "")
        elif outcome == "passed" and report.skipped:
            outcome = "skipped"
        self.by_id[report.nodeid] = (outcome, secs + report.duration, why)


def _pytest(ids: list[str], *extra: str) -> _Outcomes:
    import pytest

    plugin = _Outcomes()
    # In this process (`-o addopts=`: not pyproject's pytest-xdist workers): the plugin sees every report.
    pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(ROOT), *extra, *ids],
                plugins=[plugin])
    return plugin


def rows(outcomes: dict[str, tuple[str, float, str]]) -> list[dict]:
    out = []
    for case, ids in CASES.items():
        parts, ok = [], True
        for i in ids:
            outcome, secs, why = outcomes.get(i, ("not run", 0.0, ""))
            ok = ok and outcome == "passed"
            parts.append(f"{i} {outcome} in {secs:.1f}s" + (f" ({why})" if why else ""))
        out.append({"case": case, "ok": ok, "detail": "; ".join(parts)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "loadtest/results/tp_cpu.json"))
    ap.add_argument("--check", action="store_true", help="collect only: every case's tests exist")
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.chdir(ROOT)  # node ids are relative to the repository root
    ids = list(dict.fromkeys(i for v in CASES.values() for i in v))
    if args.check:
        got = _pytest(ids, "--collect-only")
        missing = sorted(set(ids) - set(got.collected))
        print("missing:", missing if missing else "none")
        return 1 if missing else 0
    t0 = time.monotonic()
    got = _pytest(ids)
    table = rows(got.by_id)
    doc = {"issue": 26, "device": "cpu", "backend": "gloo", "command": "python -m loadtest.tp_cpu",
           "seconds": round(time.monotonic() - t0, 1), "rows": table}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in table:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}")
    return 0 if all(r["ok"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
