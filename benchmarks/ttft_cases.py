"""Issue 35's TTFT cases against one server: per case, the client's TTFT, the server's own (with its
parts) and the floor the first token could reach, as rows of `ttft_h200.json`.

A case is (users, prompt tokens, cached tokens): `users` streams send requests back to back, each a
prompt of exactly `prompt_tokens` token ids (the completions API takes ids: no tokenizer guesses),
unique per request; with `cached_tokens`, the first `cached_tokens` ids are one prefix shared by every
request of the case, sent once before the case so that the prefix cache holds it. Rows:

    {model, users, prompt_tokens, cached_tokens, client_ttft_p50_ms, client_ttft_p99_ms,
     server_ttft_p50_ms, server_parts_p50_ms, prefill_device_ms, decode_step_ms, floor_ms}

client TTFT: the request's start to the SSE chunk carrying its first token (loadtest.records.
token_chunks); server: `/stats` request records of the case's window (router.stats.step_stats.TTFTPoints:
the gateway's HTTP app getting the request to its first token's event written, and the parts adding
up to it); prefill_device_ms: the
median device time of the prefill pass that completed a prompt (its uncached tokens); decode_step_ms:
the median device time of the decode steps in the window; floor_ms = prefill_device_ms +
decode_step_ms + 1 (the issue's definition).

Beside the rows, `tails` (one per row, same order) places each case's slowest first tokens: the client's
slowest TTFTs, and the server's slowest requests with their parts. Where the server's slowest match the
client's, the parts say which step took the time; where they do not, it was outside the server's stamps.

    python -m benchmarks.ttft_cases --url http://127.0.0.1:8000 --model-name llama-1b-shape --vocab-size 128256 \\
        --cases 1x128,1x512,1x2048,1x2048c1920 --levels 1,2,4,8,16,32,64,128,256 --out rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.sse_connection import SSEConnection
from loadtest.report import percentile
from loadtest.server_stats import ServerStatsPoller, summarize_requests

ROW_FIELDS = ("model", "users", "prompt_tokens", "cached_tokens", "client_ttft_p50_ms", "client_ttft_p99_ms",
              "server_ttft_p50_ms", "server_parts_p50_ms", "prefill_device_ms", "decode_step_ms", "floor_ms")


@dataclass(frozen=True)
class Case:
    users: int
    prompt_tokens: int
    cached_tokens: int = 0

    @classmethod
    def parse(cls, text: str) -> Case:
        """"UxP" or "UxPcC": U users, P-token prompts of which the first C are a shared (cached) prefix."""
        users, rest = text.split("x")
        prompt, _, cached = rest.partition("c")
        case = cls(int(users), int(prompt), int(cached or 0))
        if case.users < 1 or not 0 <= case.cached_tokens < case.prompt_tokens:
            raise argparse.ArgumentTypeError(f"bad case {text!r}: users >= 1, 0 <= cached < prompt")
        return case


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def stream_request(conn: SSEConnection, body: dict) -> tuple[float, float, str] | str:
    """One streamed request on `conn` -> (its start, the bytes of the event carrying its first token read:
    perf_counter each; the response's id), or why it failed. The request's bytes (its JSON body, headers)
    are built before its start: encoding it is the client's own work before it sends, no part of the
    server's TTFT (benchmarks/ttft_http.py measured ~0.1 ms of it on the CPU host)."""
    return await conn.stream(conn.request("/v1/completions", body))


async def _stream(conn: SSEConnection, model: str, prompt: list[int], output_tokens: int) -> float | str:
    """One streamed request; its TTFT (ms) to the chunk carrying its first token, or why it failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    got = await stream_request(conn, body)
    if isinstance(got, str):
        return got
    return (got[1] - got[0]) * 1e3


def _run_loop(main):
    """uvloop where it is installed (a client loop's own cost per event is part of every TTFT it reads)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _run_users(url: str, model: str, users: range, prefix: list[int], unique: int, vocab: int, output_tokens: int,
               requests: int, seconds: float, seed: int, start_at: float
               ) -> tuple[list[float], list[str], float, float, float]:
    """One process's share of a case's users, from wall-clock `start_at` on: each sends until it made
    `requests` requests or `seconds` passed, on its own connection (opened before the window). -> (TTFTs in
    ms, failures' reasons, its start and end, the CPU seconds its loop's thread used in between)."""
    ttfts: list[float] = []
    failures: list[str] = []

    async def user(conn, i):
        r = random.Random(seed * 1000 + i)
        until = time.perf_counter() + seconds
        for _ in range(requests):
            if time.perf_counter() >= until:
                break
            got = await _stream(conn, model, prefix + _ids(r, unique, vocab), output_tokens)
            (failures if isinstance(got, str) else ttfts).append(got)

    async def run() -> tuple[float, float, float]:
        conns = [SSEConnection(url) for _ in users]
        try:
            # One untimed request first: a client process's first request pays its own lazy imports. On the
            # H200 host each new client process had one request of 68-95 ms (the others <= 13 ms, the
            # server's slowest 10-24 ms: loadtest/results/ttft_recheck_h200.md), which made the p99 of a
            # 60-request case.
            await _stream(conns[0], model, _ids(random.Random(seed), 4, vocab), 1)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            # The connections open after the wait: the API server closes one idle for 5 s (its keep-alive).
            for conn in conns:
                await conn.connect()
            # This thread's CPU: the loop reading the streams (not the stats poller's thread, where it shares
            # the process).
            start, cpu0 = time.time(), time.thread_time()
            await asyncio.gather(*(user(conn, i) for conn, i in zip(conns, users)))
            return start, time.time(), time.thread_time() - cpu0
        finally:
            for conn in conns:
                conn.close()

    start, end, cpu_s = _run_loop(run())
    return ttfts, failures, start, end, cpu_s


def run_case(url: str, model: str, case: Case, vocab: int, output_tokens: int, requests: int, seconds: float,
             seed: int = 0, users_per_process: int = 16) -> tuple[list[float], list[str], float, float, list[float]]:
    """Runs the case: its users send until each made `requests` requests or `seconds` passed (whichever
    comes first), at most `users_per_process` of them on one process's event loop (one loop reading the
    streams of 64 users of 256 tokens each can itself be the bottleneck: on one H200 at a9322c6 the client's
    TTFT p50 was 193 ms where the server's was 21 ms). -> (client TTFTs in ms, the failed requests' reasons, the
    window's start and end (time.time()), each client process's share of one core over its window)."""
    rng = random.Random(seed)
    prefix = _ids(rng, case.cached_tokens, vocab)
    if prefix:  # the shared prefix into the cache first, outside the window

        async def warm():
            conn = SSEConnection(url)
            try:
                got = await _stream(conn, model, prefix + _ids(rng, 1, vocab), 1)
            finally:
                conn.close()
            if isinstance(got, str):
                raise RuntimeError(f"the shared prefix's request failed: {got}")

        asyncio.run(warm())
    shares = [range(i, min(i + users_per_process, case.users)) for i in range(0, case.users, users_per_process)]
    common = (prefix, case.prompt_tokens - case.cached_tokens, vocab, output_tokens, requests, seconds, seed)
    if len(shares) == 1:
        results = [_run_users(url, model, shares[0], *common, start_at=0.0)]
    else:  # spawned (not forked: this process runs the stats poller's thread); all start at one time
        with ProcessPoolExecutor(len(shares), mp_context=multiprocessing.get_context("spawn")) as pool:
            start_at = time.time() + 3.0 + 0.1 * len(shares)  # past the children's imports
            futures = [pool.submit(_run_users, url, model, share, *common, start_at=start_at) for share in shares]
            results = [f.result() for f in futures]
    ttfts = [t for r in results for t in r[0]]
    failures = [f for r in results for f in r[1]]
    busy = [round(r[4] / (r[3] - r[2]), 3) if r[3] > r[2] else 0.0 for r in results]
    return ttfts, failures, min(r[2] for r in results), max(r[3] for r in results), busy


def build_row(model_name: str, case: Case, ttfts: list[float], reqs: list, poller: ServerStatsPoller, t0: float,
              t1: float) -> dict:
    """reqs: the server's records of the requests whose first token came in the window [t0, t1)."""
    steps = [s.step_ms for s in poller.records if t0 <= s.t < t1]
    srv = summarize_requests(reqs)
    device = srv.get("server_forward_device_p50_ms")
    step = round(statistics.median(steps), 3) if steps else None
    row = {"model": model_name, "users": case.users, "prompt_tokens": case.prompt_tokens,
           "cached_tokens": case.cached_tokens, "client_ttft_p50_ms": percentile(ttfts, 50),
           "client_ttft_p99_ms": percentile(ttfts, 99), "server_ttft_p50_ms": srv["server_ttft_p50_ms"],
           "server_parts_p50_ms": srv["server_ttft_parts_p50_ms"], "prefill_device_ms": device,
           "decode_step_ms": step,
           "floor_ms": None if device is None or step is None else round(device + step + 1.0, 3)}
    assert tuple(row) == ROW_FIELDS
    return row


TAIL_REQUESTS = 3  # per case: the client's and the server's slowest this many


BURST_S = 0.001  # arrivals at the prefill worker this close to another one count as one burst


def queue_profile(reqs: list) -> dict:
    """How the requests met the prefill worker: the `prefill_queue` part's p10 / p50 / p90 (ms), and the
    fraction that reached the worker within BURST_S of another request. Closed-loop users with one output
    length finish in the same decode step when they were prefilled in the same pass, and send their next
    requests together: the first of such a burst starts a pass alone and the others wait for it, which
    shows as a queue of ~0 for some requests and ~a pass for the rest while the worker is mostly idle."""
    arrivals, queue = [], []
    for r in reqs:
        parts = r.parts_ms or {}
        if "prefill_queue" not in parts:
            continue  # prefilled on its decode worker
        before = 0.0
        for name, ms in parts.items():  # consecutive parts: the worker got it where prefill_queue begins
            if name == "prefill_queue":
                break
            before += ms
        arrivals.append(r.t_first - r.ttft_ms / 1e3 + before / 1e3)
        queue.append(parts["prefill_queue"])
    arrivals.sort()
    near = sum(1 for i, t in enumerate(arrivals)
               if (i > 0 and t - arrivals[i - 1] <= BURST_S) or (i + 1 < len(arrivals) and arrivals[i + 1] - t <= BURST_S))
    return {"prefill_queue_p10_p50_p90_ms": [round(percentile(queue, q), 3) for q in (10, 50, 90)] if queue else None,
            "arrived_in_bursts": round(near / len(arrivals), 3) if arrivals else None}


def build_tail(model_name: str, case: Case, ttfts: list[float], reqs: list, client_busy: list[float]) -> dict:
    """The case's slowest first tokens: the client's TTFTs and the server's slowest records (parts) among
    `reqs`, the window's (build_row); client_busy: each client process's CPU over the window, in cores (near
    1.0: that process's loop was the limit, and its lateness is in the TTFTs it read); queue_profile."""
    profile = queue_profile(reqs)
    reqs = sorted(reqs, key=lambda r: -r.ttft_ms)
    return {"model": model_name, "users": case.users, "prompt_tokens": case.prompt_tokens,
            "cached_tokens": case.cached_tokens, "requests": len(ttfts), "client_cpu_per_process": client_busy,
            **profile,
            "client_ttft_slowest_ms": [round(t, 3) for t in sorted(ttfts, reverse=True)[:TAIL_REQUESTS]],
            "server_ttft_p99_ms": round(percentile([r.ttft_ms for r in reqs], 99), 3) if reqs else None,
            "server_slowest": [{"ttft_ms": r.ttft_ms, "t_first": r.t_first, "parts_ms": r.parts_ms,
                                "forward_device_ms": r.forward_device_ms, "forward_host_ms": r.forward_host_ms}
                               for r in reqs[:TAIL_REQUESTS]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ttft_cases", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-name", required=True, help="the rows' `model` (the shape's name)")
    ap.add_argument("--vocab-size", type=int, required=True, help="prompt ids are drawn below it")
    ap.add_argument("--cases", default="", help="comma-separated UxP or UxPcC (1x2048c1920: 1920 cached)")
    ap.add_argument("--levels", default="", help="users at --level-prompt tokens (the ITL run's levels)")
    ap.add_argument("--level-prompt", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=16, help="per request of a case")
    ap.add_argument("--level-output-tokens", type=int, default=256, help="per request of a level (the ITL run's)")
    ap.add_argument("--requests", type=int, default=60, help="per user of a case, at most")
    ap.add_argument("--seconds", type=float, default=15.0, help="per case, at most")
    ap.add_argument("--users-per-process", type=int, default=16,
                    help="a case's users are spread over client processes of at most this many each")
    ap.add_argument("--out", required=True, help="JSON {rows: [...]}; rows already there are kept")
    args = ap.parse_args(argv)
    if args.users_per_process < 1:
        ap.error("--users-per-process must be >= 1")
    url = args.url.rstrip("/")
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    todo = [(Case.parse(c), args.output_tokens) for c in args.cases.split(",") if c]
    todo += [(Case(int(u), args.level_prompt), args.level_output_tokens) for u in args.levels.split(",") if u]
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    doc["client"] = (f"benchmarks.ttft_cases: benchmarks.sse_connection (httptools on uvloop, a connection per user), "
                     f"at most {args.users_per_process} users per client process (each its own event loop)")
    poller = ServerStatsPoller(url, interval_s=0.25).start()
    try:
        for i, (case, output_tokens) in enumerate(todo):
            name = f"{args.model_name} {case.users}x{case.prompt_tokens}c{case.cached_tokens}"
            try:
                ttfts, failures, t0, t1, busy = run_case(url, model, case, args.vocab_size, output_tokens, args.requests,
                                                   args.seconds, seed=i + 1, users_per_process=args.users_per_process)
                time.sleep(1.0)  # the window's last records reach /stats and the poller (every 0.25 s)
                reqs = [r for r in poller.requests if t0 <= r.t_first < t1]
                row = build_row(args.model_name, case, ttfts, reqs, poller, t0, t1)
                tail = build_tail(args.model_name, case, ttfts, reqs, busy)
            except Exception as e:  # noqa: BLE001 - the case is named in `errors`; the next ones still run
                traceback.print_exc()
                doc.setdefault("errors", []).append(f"{name}: {e!r}")
                out.write_text(json.dumps(doc, indent=1))
                continue
            doc["rows"].append(row)
            doc.setdefault("tails", []).append(tail)
            if failures:  # the row is over the requests that got a first token; the rest are named here
                doc.setdefault("errors", []).append(
                    f"{name}: {len(failures)} of "
                    f"{len(failures) + len(ttfts)} requests failed (first: {failures[0]})")
            out.write_text(json.dumps(doc, indent=1))
            print(json.dumps(row), f"failed {len(failures)}" if failures else "", flush=True)
    finally:
        poller.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
