"""`pdserve loadtest` / `python -m loadtest.run`: ITL per decode batch size, client and server side.

Runs Locust headless in its own process (Locust monkey-patches ssl and sockets with gevent at import)
against a gateway URL, or against a cluster it starts itself (`--start-cluster`: `pdserve serve` as a
subprocess, waited for on /ready, stopped at the end). While Locust walks the concurrency steps, this
process polls the gateway's step records (loadtest.server_stats) and prints one progress line per
step; at the end it writes, under --out:

    locust_stats.csv, locust_stats_history.csv, locust_failures.csv ...  Locust's own CSVs
    events-<pid>.csv, steps.jsonl, server_steps.jsonl                     raw client / server records
    summary.json (or --summary)    {"config", "rows": [one per step], ...}
    itl.png (or --plot)            ITL against batch size, with server step time and padding

and prints the table. Exit status: 0, or 1 if any stream stalled or failed (the report is written anyway).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from cluster.errors import PdserveError
from deploy.gpu_sharing import gpu_sharing
from loadtest.event_table import read_events
from loadtest.records import read_step_log, step_windows
from loadtest.report import build_rows, format_table, progress_line, target_checks, write_plot, write_summary
from loadtest.server_stats import ServerStatsPoller

REPO = Path(__file__).resolve().parent.parent


def default_out_dir(now: float | None = None) -> Path:
    """Where a run writes when --out is not given: the current directory's pdserve-loadtest/ (an
    installed pdserve lives in site-packages, which is no place for results)."""
    return Path.cwd() / "pdserve-loadtest" / time.strftime("run-%Y%m%d-%H%M%S", time.localtime(now))
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL (loopback only, see --allow-remote)")
    t.add_argument("--allow-remote", action="store_true", help="permit a non-loopback --url")
    t.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""), help="bearer key for the gateway")
    t.add_argument("--model-name", default=None, help="`model` field of requests (default: first of /v1/models)")
    c = p.add_argument_group("cluster (with --start-cluster)")
    c.add_argument("--start-cluster", action="store_true", help="start `pdserve serve` on a free loopback port")
    c.add_argument("--model", default=None, help="model directory for the started cluster (default: demo model)")
    c.add_argument("--prefill-workers", type=int, default=1)
    c.add_argument("--decode-workers", type=int, default=1)
    c.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `pdserve serve` (repeatable, e.g. --serve-arg=--dtype=bfloat16)")
    c.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready")
    w = p.add_argument_group("workload")
    w.add_argument("--steps", default="1,2,4,8,16,32,64,128", help="comma-separated concurrency levels")
    w.add_argument("--step-duration", type=float, default=30.0, help="seconds per level")
    w.add_argument("--warmup", type=float, default=None,
                   help="seconds discarded at the start of each level, after all its users run "
                        "(default: a third of --step-duration)")
    w.add_argument("--prompt-tokens", type=int, default=128)
    w.add_argument("--output-tokens", type=int, default=128)
    w.add_argument("--prompt-text", action="store_true", default=True,
                   help="send text prompts (the default: a workload that decodes to text)")
    w.add_argument("--prompt-ids", action="store_true",
                   help="send random token ids (--prompt-id-range) instead of text prompts")
    w.add_argument("--prompt-id-range", default="10,250", help="LOW,HIGH for random prompt token ids")
    w.add_argument("--stall-timeout", type=float, default=10.0,
                   help="seconds without a token after which a stream counts as stalled (failed)")
    w.add_argument("--start-stagger", type=float, default=None,
                   help="new users start within uniform(0, S) s so they do not run in lock-step "
                        "(default: min(2, warm-up / 2))")
    w.add_argument("--processes", type=int, default=None,
                   help="Locust worker processes (default: 1 up to 16 users, else min(4, cpus / 4))")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="output directory (default: ./pdserve-loadtest/run-<time>, under "
                   "the current directory: never inside the installed package)")
    o.add_argument("--summary", default=None, help="JSON summary path (default: OUT/summary.json)")
    o.add_argument("--plot", default=None, help="PNG path (default: OUT/itl.png)")
    o.add_argument("--stats-interval", type=float, default=0.5, help="seconds between /stats polls")
    o.add_argument("--title", default="", help="plot title")


# -- helpers ----------------------------------------------------------------------------------------
def _check_url(url: str, allow_remote: bool) -> None:
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise PdserveError(f"--url must be http(s)://HOST:PORT, got {url!r}")
    if allow_remote or u.hostname == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(u.hostname).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise PdserveError(f"--url {url} is not a loopback address; pass --allow-remote to load a remote server")


def _auth(api_key: str) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _parse_steps(text: str) -> list[int]:
    try:
        steps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PdserveError(f"--steps must be comma-separated integers, got {text!r}") from None
    if not steps or min(steps) < 1:
        raise PdserveError("--steps needs at least one level, each >= 1")
    return steps


class ClusterProcess:
    """`pdserve serve` as a subprocess in its own process group, logging to OUT/serve.log."""

    def __init__(self, args: argparse.Namespace, out: Path):
        # Port 0: the server binds a free port itself and prints its URL (a port picked here could be
        # taken by one of Ray's processes before the server binds it).
        self.url: str | None = None
        cmd = [sys.executable, "-m", "deploy.cli", "serve"]
        if args.model:
            cmd.append(args.model)
        cmd += ["--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers),
                "--host", "127.0.0.1", "--port", "0", *args.serve_arg]
        self.cmd = cmd
        self.log_path = out / "serve.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float, headers: dict) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PdserveError(f"`pdserve serve` exited with {self.proc.returncode} before /ready; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            if self.url is None:
                m = re.search(r"serving \S+ at (http://\S+)/v1", self.log_path.read_text(errors="replace"))
                self.url = m.group(1) if m else None
            try:
                if self.url and httpx.get(self.url + "/ready", headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise PdserveError(f"`pdserve serve` was not ready within {timeout_s:g}s; see {self.log_path}")

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


def _model_name(url: str, headers: dict) -> str:
    try:
        data = httpx.get(url + "/v1/models", headers=headers, timeout=5.0).json().get("data") or []
        if data:
            return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return "pdserve"


def _locust_command(args: argparse.Namespace, url: str, out: Path, model: str, processes: int, stagger: float) -> list[str]:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
           "--csv", str(out / "locust"), "--csv-full-history", "--only-summary", "--loglevel", "WARNING",
           "--exit-code-on-error", "0", "--stop-timeout", "0",
           "--steps", args.steps, "--step-duration", f"{args.step_duration:g}",
           "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
           "--prompt-id-range", args.prompt_id_range, "--model-name", model,
           "--stall-timeout", f"{args.stall_timeout:g}", "--start-stagger", f"{stagger:g}",
           "--events-dir", str(out)]
    if args.prompt_ids:
        cmd.append("--prompt-ids")
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    return cmd


# -- the run ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    steps = _parse_steps(args.steps)
    if args.step_duration <= 0:
        raise PdserveError("--step-duration must be > 0")
    warmup = args.step_duration / 3 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.step_duration:
        raise PdserveError("--warmup must be >= 0 and shorter than --step-duration")
    stagger = min(2.0, warmup / 2) if args.start_stagger is None else args.start_stagger
    processes = args.processes or (1 if max(steps) <= 16 else max(1, min(4, (os.cpu_count() or 4) // 4)))
    out = Path(args.out or default_out_dir()).resolve()
    if out.exists():
        for stale in list(out.glob("events-*.csv")) + [out / "steps.jsonl", out / "server_steps.jsonl"]:
            stale.unlink(missing_ok=True)  # records are appended; a rerun must not mix with the last
    out.mkdir(parents=True, exist_ok=True)
    headers = _auth(args.api_key)

    cluster = None
    if args.start_cluster:
        cluster = ClusterProcess(args, out)
        print(f"starting cluster: {' '.join(cluster.cmd)} (log: {cluster.log_path})", flush=True)
        url = None
    else:
        url = args.url.rstrip("/")
        _check_url(url, args.allow_remote)
    try:
        if cluster is not None:
            cluster.wait_ready(args.ready_timeout, headers)
            url = cluster.url
            print(f"cluster ready at {url}", flush=True)
        model = args.model_name or _model_name(url, headers)
        return _run_locust(args, url, out, model, steps, warmup, stagger, processes, headers)
    finally:
        if cluster is not None:
            cluster.stop()


def _run_locust(args, url, out, model, steps, warmup, stagger, processes, headers) -> int:
    poller = ServerStatsPoller(url, interval_s=args.stats_interval, headers=headers,
                               raw_path=out / "server_steps.jsonl").start()
    print(f"server step records: {poller.source or 'none (no /stats, no pdserve metrics)'}", flush=True)
    cmd = _locust_command(args, url, out, model, processes, stagger)
    total_s = len(steps) * args.step_duration
    print(f"locust: {len(steps)} steps {steps} x {args.step_duration:g}s (warm-up {warmup:g}s), "
          f"prompt {args.prompt_tokens} / output {args.output_tokens} tokens, {processes} process(es), "
          f"~{total_s:.0f}s; output in {out}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with open(out / "locust.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        printed: set[int] = set()
        deadline = time.monotonic() + total_s + 120  # Locust stops by itself; this is the backstop
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=15)
                    break
                time.sleep(0.5)
                _print_progress(out, warmup, poller, printed, len(steps))
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            raise
        finally:
            poller.stop()
    if proc.returncode not in (0, None) and not read_step_log(out):
        tail = "\n".join((out / "locust.log").read_text(errors="replace").splitlines()[-20:])
        raise PdserveError(f"locust exited with {proc.returncode} before the first step; {out / 'locust.log'}:\n{tail}")

    windows = step_windows(read_step_log(out), warmup, now=time.time())
    rows = build_rows(read_events(out), windows, poller.summarize)  # the events read once, after the last level
    for row in rows:
        if row["step"] not in printed:
            print(progress_line(row, len(steps)), flush=True)
    config = {"url": url, "model": model, "steps": steps, "step_duration_s": args.step_duration, "warmup_s": warmup,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "prompt": "token ids" if args.prompt_ids else "text",
              "timing": "per token: TTFT to the first token's chunk, ITL one sample per token (a chunk of k tokens "
                        "after a gap g counts k gaps of g / k; chunk_itl_* are the gaps between chunks)",
              "stall_timeout_s": args.stall_timeout, "start_stagger_s": stagger, "locust_processes": processes,
              "started_cluster": bool(args.start_cluster),
              # how the cluster this run started shares its GPU (deploy/gpu_sharing.py); None: not started here
              "gpu_sharing": gpu_sharing() if args.start_cluster else None, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    summary = Path(args.summary) if args.summary else out / "summary.json"
    plot = Path(args.plot) if args.plot else out / "itl.png"
    summary.parent.mkdir(parents=True, exist_ok=True)
    plot.parent.mkdir(parents=True, exist_ok=True)
    checks = target_checks(rows)
    write_summary(summary, rows, config, {"checks": checks, "server_stats_source": poller.source, "server_stats_gaps": poller.gaps,
                                          "server_step_records": len(poller.records), "output_dir": str(out)})
    made = write_plot(rows, plot, args.title)
    print()
    print(format_table(rows))
    print("\ntargets: " + "; ".join(f"{k} {v['target']}: {'met' if v['met'] else 'missed' if v['met'] is False else '-'}"
                                      for k, v in checks.items()))
    print(f"summary: {summary}\nplot: {made or '(no data)'}\nlocust CSVs and raw events: {out}")
    if poller.gaps:
        print(f"note: {poller.gaps} /stats polls found records missing since the previous poll "
              f"(poll faster with --stats-interval)")
    bad = sum(r["stalls"] + r["errors"] for r in rows)
    return 1 if bad else 0


def _print_progress(out: Path, warmup: float, poller, printed: set[int], n_steps: int) -> None:
    """One line per step that ended (a second ago: its last events are written) and was not printed."""
    windows = step_windows(read_step_log(out), warmup)
    done = [w for w in windows if w.index not in printed and time.time() > w.end + 1.0]
    if not done:
        return
    events = read_events(out)
    for row in build_rows(events, done, poller.summarize):
        printed.add(row["step"])
        print(progress_line(row, n_steps), flush=True)


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.run") -> int:
    """`pdserve loadtest ...` and `python -m loadtest.run ...`: 0, 1 if streams stalled or failed, 2 on bad input."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
