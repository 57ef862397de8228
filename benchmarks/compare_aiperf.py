"""Side by side: the Locust report (`pdserve loadtest`) and NVIDIA aiperf, same server, same concurrency.

    python -m benchmarks.compare_aiperf OUT_DIR

reads OUT_DIR/locust-c<N>/summary.json (loadtest.run) and aiperf's profile_export_aiperf.json under
OUT_DIR/aiperf-c<N>/ (its profiling phase's, without warm-up, where it writes one)
for every concurrency N that has both, writes OUT_DIR/aiperf_vs_locust.json and prints a table.

The two tools name different things ITL (loadtest/README.md, "Locust and aiperf"):
- Locust `itl`: every gap between consecutive token chunks, pooled over requests (p50 of gaps);
  aiperf `inter_chunk_latency` is the same quantity.
- aiperf `inter_token_latency`: per request, (latency - TTFT) / (output tokens - 1), then p50 over
  requests; Locust's `tpot` is the same quantity.
So the like-for-like pairs are (Locust itl, aiperf inter_chunk_latency) and (Locust tpot, aiperf
inter_token_latency); both tools time TTFT from sending the request to the first non-empty chunk.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PAIRS = (  # (row key, Locust summary key, aiperf metric tag)
    ("chunk_gap_p50_ms", "itl_p50_ms", "inter_chunk_latency"),
    ("per_request_itl_p50_ms", "tpot_p50_ms", "inter_token_latency"),
    ("ttft_p50_ms", "ttft_p50_ms", "time_to_first_token"),
)


def _aiperf_metrics(d) -> dict[str, dict]:
    """{tag: {"p50": ..., "avg": ..., "unit": ...}} wherever aiperf put its metric records."""
    found: dict[str, dict] = {}

    def walk(x, key=None):
        if isinstance(x, dict):
            if key is not None and ("p50" in x or "avg" in x):
                found.setdefault(key, x)
            for k, v in x.items():
                walk(v, x.get("tag", k) if isinstance(v, dict) else k)
        elif isinstance(x, list):
            for v in x:
                walk(v, v.get("tag") if isinstance(v, dict) else key)
    walk(d)
    return found


def _ms(m: dict | None, stat: str = "p50") -> float | None:
    if not m or m.get(stat) is None:
        return None
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}.get(str(m.get("unit", "ms")).lower(), 1.0)
    return round(float(m[stat]) * scale, 4)


def compare(out: Path) -> list[dict]:
    rows = []
    dirs = [p for p in out.glob("locust-c*") if p.is_dir() and re.fullmatch(r"locust-c\d+", p.name)]
    for locust_dir in sorted(dirs, key=lambda p: int(p.name[len("locust-c"):])):
        c = int(locust_dir.name[len("locust-c"):])
        summary = locust_dir / "summary.json"
        # aiperf >= 0.13 also writes each phase apart: the profiling phase excludes its warm-up requests.
        exports = sorted((out / f"aiperf-c{c}").rglob("profile_export_aiperf.json"),
                         key=lambda f: ("profiling" not in f.parts, len(f.parts)))
        if not summary.is_file() or not exports:
            continue
        lrow = json.loads(summary.read_text())["rows"][0]
        metrics = _aiperf_metrics(json.loads(exports[0].read_text()))
        row = {"concurrency": c, "server_step_ms": lrow.get("server_step_ms"),
               "server_batch_size": lrow.get("server_batch_size")}
        for name, lkey, tag in PAIRS:
            lv, av = lrow.get(lkey), _ms(metrics.get(tag))
            row[f"locust_{name}"] = lv
            row[f"aiperf_{name}"] = av
            row[f"{name}_aiperf_over_locust"] = round(av / lv, 4) if lv and av else None
        rows.append(row)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    rows = compare(out)
    (out / "aiperf_vs_locust.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    cols = ["concurrency", "server_step_ms", "locust_chunk_gap_p50_ms", "aiperf_chunk_gap_p50_ms",
            "locust_per_request_itl_p50_ms", "aiperf_per_request_itl_p50_ms", "locust_ttft_p50_ms", "aiperf_ttft_p50_ms"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(k)) for k in cols))
    print(f"wrote {out / 'aiperf_vs_locust.json'}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
