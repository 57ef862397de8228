"""TTFT three ways on one server: the Locust report, a plain streaming client, and the server's own
per-request records, at a few concurrency levels.

- report: `loadtest.run`'s rows (per-token TTFT: request start to the chunk carrying the first token),
  from a summary it wrote (`--report-summary`, e.g. the ITL run's, against the same server) or from a
  short Locust run this script starts (`--steps` of `--step-duration`);
- client: `--users` asyncio streams (httpx), each sending the load test's request (the same text
  prompt, max_tokens, ignore_eos, continuous usage) back to back for `--client-seconds`; TTFT the same
  way, by the same rule (loadtest.records.token_chunks);
- server: `/stats` request records (the gateway's HTTP app getting the request to its first token's
  event written, and the gateway's, router's and prefill worker's parts) of the requests whose first token fell in each window.

One row per level: {users, report_ttft_p50_ms, report_ttft_p99_ms, client_ttft_p50_ms,
client_ttft_p99_ms, server_ttft_p50_ms} (server over the report's window; `server_ttft_p50_ms_client`
over the client's), and `checks`: TTFT p99 <= 2x p50 at 1 and 4 users, the report's p50 within 10 %
of the client's and of the server's.

    python -m benchmarks.bench_ttft --url http://127.0.0.1:8000 --report-summary OUT/itl_h200.json --out OUT/ttft_h200.json
    python -m benchmarks.bench_ttft --start-cluster --users 1,4 --out /tmp/ttft.json     # CPU, the demo model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from loadtest.records import PROMPT_WORDS, token_chunks
from loadtest.report import percentile
from loadtest.server_stats import ServerStatsPoller, summarize_requests

TOLERANCE = 0.10
P99_OVER_P50 = 2.0
P99_LEVELS = (1, 4)


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(words))


async def _user(url: str, model: str, prompt_tokens: int, output_tokens: int, until: float, seed: int,
                out: list[tuple[float, float]]) -> None:
    """Requests back to back until `until` (perf_counter); appends (first-token wall time, TTFT ms)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        while time.perf_counter() < until:
            body = {"model": model, "prompt": _prompt(rng, prompt_tokens), "max_tokens": output_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            wall0, t0 = time.time(), time.perf_counter()
            lines: list[tuple[float, bytes]] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0.2)
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        lines.append((time.perf_counter(), line.encode()))
            carried, _, err = token_chunks(lines)
            if carried and err is None:
                first = carried[0][0]
                out.append((wall0 + first - t0, (first - t0) * 1e3))


def plain_client(url: str, model: str, users: int, seconds: float, prompt_tokens: int,
                 output_tokens: int) -> tuple[list[tuple[float, float]], float, float]:
    """(first-token time, TTFT ms) of every request `users` plain streams made in `seconds`, and the
    window (wall clock) they ran in."""
    out: list[tuple[float, float]] = []
    start = time.time()
    until = time.perf_counter() + seconds

    async def run():
        await asyncio.gather(*(_user(url, model, prompt_tokens, output_tokens, until, 1000 * users + i, out)
                               for i in range(users)))

    asyncio.run(run())
    return out, start, time.time()


def _model(url: str) -> str:
    try:
        return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "pdserve"


def _locust_report(url: str, levels: list[int], step_s: float, warmup_s: float, prompt_tokens: int,
                   output_tokens: int, out_dir: Path) -> dict:
    from loadtest.run import main as run_main

    summary = out_dir / "ttft_locust_summary.json"
    run_main(["--url", url, "--steps", ",".join(map(str, levels)), "--step-duration", f"{step_s:g}",
              "--warmup", f"{warmup_s:g}", "--prompt-tokens", str(prompt_tokens), "--output-tokens",
              str(output_tokens), "--stats-interval", "0.25", "--out", str(out_dir / "ttft_locust"),
              "--summary", str(summary), "--plot", str(out_dir / "ttft_locust.png")])
    if not summary.is_file():  # (loadtest.run printed why: no locust, the server gone...)
        raise SystemExit(f"bench_ttft: the load-test report wrote no summary ({summary}); see its output above")
    return json.loads(summary.read_text())


def build_rows(levels, report_rows: list[dict], client: dict[int, tuple], requests) -> list[dict]:
    rows = []
    for users in levels:
        rep = next((r for r in report_rows if r["batch_size"] == users), {})
        ttfts, t0, t1 = client.get(users, ([], None, None))
        client_ms = [ms for _, ms in ttfts]
        in_client = [r for r in requests if t0 is not None and t0 <= r.t_first < t1]
        rows.append({
            "users": users,
            "report_ttft_p50_ms": rep.get("ttft_p50_ms"), "report_ttft_p99_ms": rep.get("ttft_p99_ms"),
            "client_ttft_p50_ms": percentile(client_ms, 50), "client_ttft_p99_ms": percentile(client_ms, 99),
            "server_ttft_p50_ms": rep.get("server_ttft_p50_ms"),
            "server_ttft_p50_ms_client": summarize_requests(in_client)["server_ttft_p50_ms"],
            "server_ttft_parts_p50_ms": rep.get("server_ttft_parts_p50_ms"),
            "report_requests": rep.get("requests"), "client_requests": len(client_ms),
            "server_requests": rep.get("server_requests"),
        })
    return rows


def checks(rows: list[dict]) -> dict:
    out = {}

    def ratio(a, b):
        return round(a / b, 4) if a and b else None

    for r in rows:
        u = r["users"]
        if u in P99_LEVELS:
            for who in ("report", "client"):
                v = ratio(r[f"{who}_ttft_p99_ms"], r[f"{who}_ttft_p50_ms"])
                out[f"users{u}/{who}_p99_over_p50"] = {"value": v, "target": f"<= {P99_OVER_P50:g}",
                                                       "met": None if v is None else v <= P99_OVER_P50}
        for other in ("client", "server"):
            v = ratio(r["report_ttft_p50_ms"], r[f"{other}_ttft_p50_ms"])
            out[f"users{u}/report_over_{other}_p50"] = {
                "value": v, "target": f"within {TOLERANCE:.0%}",
                "met": None if v is None else abs(v - 1) <= TOLERANCE}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running gateway (else --start-cluster)")
    ap.add_argument("--start-cluster", action="store_true", help="serve the demo model on CPU for the run")
    ap.add_argument("--users", default="1,4,16")
    ap.add_argument("--report-summary", default=None, help="a loadtest.run summary against this server (its rows)")
    ap.add_argument("--step-duration", type=float, default=12.0, help="Locust seconds per level (no --report-summary)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--client-seconds", type=float, default=8.0)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--out", default="loadtest/results/ttft_h200.json")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.users.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / "ttft_raw"  # Locust's files and serve.log, when this script runs them
    if args.start_cluster or not args.report_summary:
        work.mkdir(exist_ok=True)
    cluster = None
    if args.start_cluster:
        from loadtest.run import ClusterProcess

        ns = argparse.Namespace(model=None, prefill_workers=1, decode_workers=1,
                                serve_arg=["--device", "cpu", "--max-model-len", "1024"])
        cluster = ClusterProcess(ns, work)
        cluster.wait_ready(600, {})
        url = cluster.url
    else:
        url = (args.url or "http://127.0.0.1:8000").rstrip("/")
    try:
        model = _model(url)
        poller = ServerStatsPoller(url, interval_s=0.25).start()
        try:
            if args.report_summary:
                report = json.loads(Path(args.report_summary).read_text())
            else:
                report = _locust_report(url, levels, args.step_duration, args.warmup, args.prompt_tokens,
                                        args.output_tokens, work)
            client = {}
            for users in levels:
                client[users] = plain_client(url, model, users, args.client_seconds, args.prompt_tokens,
                                             args.output_tokens)
                print(f"plain client, {users} users: {len(client[users][0])} requests", flush=True)
            time.sleep(0.6)
        finally:
            poller.stop()
        rows = build_rows(levels, report.get("rows", []), client, poller.requests)
    finally:
        if cluster is not None:
            cluster.stop()
    doc = {"url": url, "model": model, "levels": levels, "prompt_tokens": args.prompt_tokens,
           "output_tokens": args.output_tokens, "report_summary": args.report_summary,
           "definitions": "TTFT per token: request start to the chunk carrying the first token (the server "
                          "sends an event per token); server: the gateway's HTTP app getting "
                          "the request to its first token's event written",
           "rows": rows, "checks": checks(rows)}
    out.write_text(json.dumps(doc, indent=1))
    print(f"{'users':>5} {'report p50':>10} {'p99':>8} {'client p50':>10} {'p99':>8} {'server p50':>10}")
    for r in rows:
        f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        print(f"{r['users']:5d} {f(r['report_ttft_p50_ms']):>10} {f(r['report_ttft_p99_ms']):>8} "
              f"{f(r['client_ttft_p50_ms']):>10} {f(r['client_ttft_p99_ms']):>8} {f(r['server_ttft_p50_ms']):>10}")
    print("checks: " + ", ".join(f"{k}={v['met']}" for k, v in doc["checks"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
