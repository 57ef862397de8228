"""`python -m loadtest.issue28_summary OUT_DIR`: issue 28's results side by side, every target with its
measured value and met / missed, from the files loadtest/run_issue28_h200.sh wrote (decode_h200.json,
transfer_h200.json, itl_h200.json, ttft_h200.json, prefix_cache_h200.json, gpu_tests.log). Writes
OUT_DIR/issue28_checks.json (all checks in one object) and prints a short table. A stage that ran
(not in --skip) but wrote no results is reported as such, its targets "not measured".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(out: Path, name: str) -> dict | None:
    p = out / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _met(m) -> str:
    return {True: "met", False: "MISSED", None: "-"}[m]


# stage (run_issue28_h200.sh's SKIP names) -> the results file it writes
STAGES = {"decode": "decode_h200.json", "transfer": "transfer_h200.json", "itl": "itl_h200.json",
          "ttft": "ttft_h200.json", "prefix": "prefix_cache_h200.json"}


def collect(out: Path, skipped: frozenset[str] = frozenset()) -> tuple[dict, list[str]]:
    checks: dict = {}
    lines: list[str] = []
    for stage, name in STAGES.items():
        if stage not in skipped and _load(out, name) is None:
            checks[f"{stage}/measured"] = {"met": False, "detail": f"not measured: {name} was not written "
                                                                   f"(see {stage}_h200.log)"}
            lines.append(f"{stage}: NOT MEASURED ({name} was not written)")
    log = out / "gpu_tests.log"
    if log.is_file():
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:]
        lines.append(f"GPU tests: {tail[0] if tail else '(empty log)'}")
        checks["gpu_tests"] = {"value": tail[0] if tail else None,
                               "met": bool(tail) and " passed" in tail[0] and "failed" not in tail[0]
                               and "error" not in tail[0]}
    dec = _load(out, "decode_h200.json")
    if dec:
        lines.append("decode step (ms): model bs floor graph xfloor eager g/e features kernels")
        for r in [r for r in dec.get("rows", []) if r.get("source") == "bench_decode" and r["mode"] == "graph"]:
            e = next((x for x in dec["rows"] if x.get("source") == "bench_decode" and x["mode"] == "eager"
                      and x["model"] == r["model"] and x["batch_size"] == r["batch_size"]), None)
            f = next((x for x in dec["rows"] if x.get("source") == "bench_decode" and x["mode"] == "graph-features"
                      and x["model"] == r["model"] and x["batch_size"] == r["batch_size"]), None)
            lines.append(f"  {r['model']:15s} {r['batch_size']:4d} {_f(r['floor_ms'])} {_f(r['step_ms'])} "
                         f"{_f(r['step_ms'] / r['floor_ms'])} {_f(e and e['step_ms'])} "
                         f"{_f(e and r['step_ms'] / e['step_ms'])} {_f(f and f['step_ms'])} {r.get('kernels_per_step')}")
        checks.update({f"decode/{k}": v for k, v in dec.get("checks", {}).items()})
    tr = _load(out, "transfer_h200.json")
    if tr:
        lines.append("transfer (ms): tokens ttft-pays served-record commit->arrival kv-ready->arrival exact")
        for r in tr.get("rows", []):
            lines.append(f"  {r['prompt_tokens']:6d} {_f(r['seconds'] * 1e3, 3)} {_f(r.get('served_transfer_s', 0) * 1e3, 3)} "
                         f"{_f(r.get('commit_to_arrival_s', 0) * 1e3, 3)} {_f(r.get('kv_ready_to_arrival_s', 0) * 1e3, 3)} "
                         f"{r['exact']}")
        checks["transfer/exact"] = {"met": bool(tr.get("rows")) and all(r["exact"] for r in tr["rows"])}
    itl = _load(out, "itl_h200.json")
    if itl:
        lines.append("ITL (ms): users srv-bs step interval ITL-p50 ITL/step tok/s delivered/capacity")
        for r in itl.get("rows", []):
            lines.append(f"  {r['batch_size']:4d} {_f(r.get('server_batch_size'), 0)} {_f(r.get('server_step_ms'))} "
                         f"{_f(r.get('server_interval_ms'))} {_f(r.get('itl_p50_ms'))} {_f(r.get('itl_p50_over_step'))} "
                         f"{_f(r.get('tokens_per_s'), 0)} {_f(r.get('delivered_over_capacity'))}")
            for why in r.get("explain") or ():
                lines.append(f"        {why}")
        checks.update({f"itl/{k}": v for k, v in itl.get("checks", {}).items()})
    tt = _load(out, "ttft_h200.json")
    if tt:
        lines.append("TTFT (ms): users report-p50 p99 client-p50 p99 server-p50")
        for r in tt.get("rows", []):
            lines.append(f"  {r['users']:4d} {_f(r['report_ttft_p50_ms'], 1)} {_f(r['report_ttft_p99_ms'], 1)} "
                         f"{_f(r['client_ttft_p50_ms'], 1)} {_f(r['client_ttft_p99_ms'], 1)} {_f(r['server_ttft_p50_ms'], 1)}")
        checks.update({f"ttft/{k}": v for k, v in tt.get("checks", {}).items()})
    pc = _load(out, "prefix_cache_h200.json")
    if pc:
        from loadtest.prefix_cache_report import check_summary

        lines.append("prefix cache: cache hit ttft-p50 ttft-p99 server-parts-p50")
        for r in pc.get("rows", []):
            lines.append(f"  {r['cache']:9s} {_f(r.get('hit_rate'), 3)} {_f(r.get('ttft_p50_ms'), 1)} "
                         f"{_f(r.get('ttft_p99_ms'), 1)} {r.get('server_ttft_parts_p50_ms')}")
        checks.update({f"prefix/{k}": v for k, v in check_summary(pc.get("rows", [])).items()})
    return checks, lines


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m loadtest.issue28_summary")
    ap.add_argument("out", nargs="?", default="loadtest/results")
    ap.add_argument("--skip", default="", help="the stages skipped (comma-separated): not reported missing")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    checks, lines = collect(out, frozenset(x for x in args.skip.split(",") if x))
    (out / "issue28_checks.json").write_text(json.dumps(checks, indent=1))
    print("\n".join(lines))
    print("\nissue 28 targets")
    for k, v in checks.items():
        val = v.get("value", v.get("detail"))
        print(f"  {_met(v.get('met')):6s} {k}" + (f": {val}" if val is not None and not isinstance(val, dict) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
