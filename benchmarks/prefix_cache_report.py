"""`python -m benchmarks.prefix_cache_report prefix_cache_h200.json`: the prefix-cache rows side by side,
and issue 17's targets checked on them:

- TTFT p50 with caching off / on >= 3 for the multi-turn workload at a rate where caching off is not
  saturated (its throughput keeps up with the offered rate: completed requests per second within 10 %
  of the request rate, none failed); the baseline is the `off` row, or else the `uncached` one (the
  same server, no prompt sharing a block);
- hit rate within 5 % (absolute) of the workload's theoretical reuse;
- disaggregated: KV bytes moved with caching on <= bytes with caching off x (1 - hit rate), within 5 %.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TTFT_SPEEDUP = 3.0
HIT_RATE_TOLERANCE = 0.05
TRANSFER_TOLERANCE = 0.05


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def saturated(row: dict) -> bool:
    """The server did not keep up with the offered load."""
    return row["failed"] > 0 or (row["throughput_rps"] or 0.0) < 0.9 * row["request_rate"]


def checks(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """(what, passed, detail) per target and per comparable pair of rows."""
    by = {(r["setup"], r["workload"], r["request_rate"], r["cache"]): r for r in rows}
    out = []
    for (setup, workload, rate, cache), on in sorted(by.items()):
        if cache != "on":
            continue
        if on["hit_rate"] is not None:
            gap = on["theoretical_reuse"] - on["hit_rate"]
            out.append((f"{setup} {workload} @{rate:g}/s: hit rate vs theoretical reuse", abs(gap) <= HIT_RATE_TOLERANCE,
                        f"{on['hit_rate']:.3f} vs {on['theoretical_reuse']:.3f}"))
        # The baseline: a server with caching off, else the same server with no prompt sharing a block.
        off = by.get((setup, workload, rate, "off")) or by.get((setup, workload, rate, "uncached"))
        if off is None:
            continue
        if workload == "multi_turn" and on["ttft_p50_ms"] and off["ttft_p50_ms"]:
            ratio = off["ttft_p50_ms"] / on["ttft_p50_ms"]
            note = " (caching off saturated at this rate: not a valid point)" if saturated(off) else ""
            out.append((f"{setup} {workload} @{rate:g}/s: TTFT p50 off/on >= {TTFT_SPEEDUP:g}",
                        ratio >= TTFT_SPEEDUP and not saturated(off), f"{ratio:.2f}x{note}"))
        if off["cache"] == "off" and off["kv_transfer_bytes"] > 0 and on["hit_rate"] is not None:
            expect = off["kv_transfer_bytes"] * (1 - on["hit_rate"])
            out.append((f"{setup} {workload} @{rate:g}/s: KV bytes moved reduced by the hit rate",
                        on["kv_transfer_bytes"] <= expect * (1 + TRANSFER_TOLERANCE) + 1,
                        f"{on['kv_transfer_bytes'] / 1e9:.2f} GB vs off {off['kv_transfer_bytes'] / 1e9:.2f} GB "
                        f"x (1 - {on['hit_rate']:.3f}) = {expect / 1e9:.2f} GB"))
    return out


def table(rows: list[dict]) -> str:
    head = ("setup", "workload", "rate", "cache", "hit", "theory", "ttft_p50", "ttft_p99", "tpot_p50", "goodput",
            "prefill_tok/s", "kv_GB")
    lines = ["  ".join(f"{h:>13}" for h in head)]
    for r in sorted(rows, key=lambda r: (r["setup"], r["workload"], r["request_rate"], r["cache"])):
        vals = (r["setup"], r["workload"], _fmt(r["request_rate"], 2), r["cache"], _fmt(r["hit_rate"], 3),
                _fmt(r["theoretical_reuse"], 3), _fmt(r["ttft_p50_ms"]), _fmt(r["ttft_p99_ms"]), _fmt(r["tpot_p50_ms"]),
                _fmt(r["goodput_rps"], 2), _fmt(r["prefill_tokens_per_s"], 0), _fmt(r["kv_transfer_bytes"] / 1e9, 3))
        lines.append("  ".join(f"{v:>13}" for v in vals))
    return "\n".join(lines)


def check_summary(rows: list[dict]) -> dict:
    """The checks as {what: {met, detail}} (for a results file's `checks`)."""
    return {what: {"met": ok, "detail": detail} for what, ok, detail in checks(rows)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.splitlines()[0])
        return 2
    rows = json.loads(Path(argv[0]).read_text())["rows"]
    print(table(rows))
    for what, ok, detail in checks(rows):
        print(f"{'PASS' if ok else 'MISS'}  {what}: {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
