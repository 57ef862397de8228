"""How long the load-test runner takes to turn a run's client events into its report rows (issue 35).

After its last level `loadtest.run` reads every `events-*.csv` of the run (loadtest.event_table) and
builds one row per level (loadtest.report.build_rows); an H200 run of nine levels (1..256 users, Locust
in 8 processes) wrote ~55 MB of events. This writes a synthetic run of about --mb MB in the
locustfile's own format and times the reading and the rows:

- Locust in --processes processes, one `events-<n>.csv` each, written per request in the order the
  requests end (EventWriter), so a file is not in time order;
- levels 1, 2, 4 .. 256 users held --mb-scaled seconds each, users kept across levels, each streaming
  256 tokens back to back, at a step of 6 + 0.04 x users ms, a chunk carrying 2 tokens more often at
  larger batches: per token an `itl` row, per chunk gap a `chunk_itl` row (records.timing_rows), per
  request `ttft`, `e2e`, `tokens`, `chunks`, `tpot`; about one request in 2000 stalls, one in 2000 fails;
  the requests still streaming at the end recorded as Locust's stop leaves them (no e2e);
- the last line of one file torn, as a killed process leaves it.

The same files (same --seed) give the same rows: `rows_sha256` in the JSON compares two versions of the
reader on them.

    python -m benchmarks.loadtest_reader --mb 55 --out loadtest/results/loadtest_reader_cpu.json
    python -m benchmarks.loadtest_reader --dry-run          # ~1 MB (the test suite runs it)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loadtest.event_table import read_events
from loadtest.records import EventWriter, append_step_log, read_step_log, step_windows, timing_rows
from loadtest.report import build_rows

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTPUT_TOKENS = 256
BYTES_PER_TOKEN = 59  # bytes of events per token streamed, ramps and the requests' rows included (calibrated at --mb 55)
T0 = 1_767_000_000.0  # wall clock of the synthetic run's start


def step_ms(users: int) -> float:
    return 6.0 + 0.04 * users


def level_seconds(mb: float) -> float:
    """Seconds per level for about `mb` MB of events: tokens/s of a level is users / step."""
    tokens_per_s = sum(u / (step_ms(u) / 1000) for u in LEVELS)
    return mb * 1e6 / (BYTES_PER_TOKEN * tokens_per_s)


def _user_requests(rng: random.Random, start: float, end: float, level_s: float) -> list[tuple[float, list]]:
    """One user's requests from `start` to the run's `end`: (when written, event rows) each."""
    out = []
    t = start
    while t < end:
        level = min(int((t - T0) // level_s), len(LEVELS) - 1)
        users = LEVELS[level]
        fate = rng.random()
        if fate < 0.0005:  # refused: an error row, then the locustfile's back-off
            out.append((t + 0.01, [(t + 0.01, level, "error", 0.0)]))
            t += 0.51
            continue
        arrival = t + (20.0 + 0.3 * users) * rng.uniform(0.8, 1.5) / 1000
        carried, n, k = [], 0, 1
        while n < OUTPUT_TOKENS and arrival < end:
            carried.append((arrival, k))
            n += k
            now_users = LEVELS[min(int((arrival - T0) // level_s), len(LEVELS) - 1)]
            # The next chunk: k tokens, one step each (more chunks of two when the batch is large).
            k = min(2 if rng.random() < min(0.3, now_users / 800) else 1, OUTPUT_TOKENS - n)
            arrival += k * step_ms(now_users) * rng.uniform(0.9, 1.25) / 1000
        rows = timing_rows(carried, level, t, t)
        last = carried[-1][0] if carried else t
        if n < OUTPUT_TOKENS:  # Locust stopped the user mid-stream: the gaps so far, no e2e
            out.append((end, rows))
            break
        if fate < 0.001:  # no token for the stall timeout (10 s): the stream is given up
            out.append((last + 10.0, rows + [(last + 10.0, level, "stall", 10000.0)]))
            t = last + 10.0
            continue
        latency = (last - t) * 1000
        rows += [(last, level, "e2e", latency), (last, level, "tokens", float(n)),
                 (last, level, "chunks", float(len(carried))),
                 (last, level, "tpot", (latency - (carried[0][0] - t) * 1000) / (n - 1))]
        out.append((last, rows))
        t = last + 0.0005
    return out


def write_run(out: Path, mb: float, processes: int, seed: int) -> dict:
    """A synthetic run's events-*.csv and steps.jsonl under `out`; its shape as a dict."""
    rng = random.Random(seed)
    level_s = level_seconds(mb)
    end = T0 + level_s * len(LEVELS)
    per_process: list[list[tuple[float, list]]] = [[] for _ in range(processes)]
    for u in range(LEVELS[-1]):
        first = next(i for i, n in enumerate(LEVELS) if n > u)
        start = T0 + first * level_s + rng.uniform(0.0, min(2.0, level_s / 6))  # loadtest.run's --start-stagger
        per_process[u % processes] += _user_requests(rng, start, end, level_s)
    for p, requests in enumerate(per_process):
        path = out / f"events-{1000 + p}.csv"
        w = EventWriter(path)
        for _, rows in sorted(requests, key=lambda r: r[0]):
            w.write(rows)
        w.close()
    torn = out / f"events-{1000 + processes - 1}.csv"
    data = torn.read_bytes()
    last_line = data.rstrip(b"\r\n").rfind(b"\n") + 1
    torn.write_bytes(data[: last_line + (len(data) - last_line) // 2])  # half of the last line
    for i, users in enumerate(LEVELS):
        append_step_log(out, {"event": "start", "step": i, "users": users, "t": T0 + i * level_s})
        append_step_log(out, {"event": "ready", "step": i, "users": users, "t": T0 + i * level_s + 0.05})
    append_step_log(out, {"event": "end", "t": end})
    return {"level_s": round(level_s, 3), "levels": list(LEVELS), "processes": processes, "seed": seed}


def measure(out: Path) -> dict:
    files = sorted(out.glob("events-*.csv"))
    mb = sum(f.stat().st_size for f in files) / 1e6
    warmup = float(json.loads((out / "shape.json").read_text())["level_s"]) / 3
    t0 = time.perf_counter()
    events = read_events(out)
    t1 = time.perf_counter()
    rows = build_rows(events, step_windows(read_step_log(out), warmup), lambda a, b: {})
    t2 = time.perf_counter()
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    return {"mb": round(mb, 2), "files": len(files), "events": len(events), "read_s": round(t1 - t0, 3),
            "rows_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3), "mb_per_s": round(mb / (t2 - t0), 1),
            "rows_sha256": digest,
            "rows": [{k: r[k] for k in ("batch_size", "itl_samples", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms",
                                        "tokens_per_s", "requests", "stalls", "errors")} for r in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=55.0, help="about this many MB of events")
    ap.add_argument("--processes", type=int, default=8, help="Locust processes: one events file each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="keep the synthetic run here (default: a temporary directory)")
    ap.add_argument("--reuse", action="store_true", help="time the run already in --dir instead of writing one")
    ap.add_argument("--repeat", type=int, default=1, help="time it this many times (the JSON keeps the fastest)")
    ap.add_argument("--dry-run", action="store_true", help="~1 MB: checks the benchmark runs")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    mb = 1.0 if args.dry_run else args.mb
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="loadtest-reader-"))
    try:
        if not args.reuse:
            work.mkdir(parents=True, exist_ok=True)
            for stale in list(work.glob("events-*.csv")) + [work / "steps.jsonl"]:
                stale.unlink(missing_ok=True)
            t0 = time.perf_counter()
            shape = write_run(work, mb, args.processes, args.seed)
            (work / "shape.json").write_text(json.dumps(shape) + "\n")
            print(f"wrote a synthetic run in {time.perf_counter() - t0:.1f} s: {shape}", flush=True)
        shape = json.loads((work / "shape.json").read_text())
        runs = [measure(work) for _ in range(max(1, args.repeat))]
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    best = min(runs, key=lambda r: r["total_s"])
    for r in runs:
        print(f"{r['mb']:.1f} MB, {r['events']} events in {r['files']} files: read {r['read_s']:.2f} s, "
              f"rows {r['rows_s']:.2f} s, total {r['total_s']:.2f} s ({r['mb_per_s']:.1f} MB/s)")
    result = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "shape": shape, "total_s_per_repeat": [r["total_s"] for r in runs], **best}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
