"""Shared-prefix traffic against a running `pdserve serve`: TTFT, goodput and prefix-cache hit rate.

Runs the workloads of benchmarks.prefix_workload (multi-turn chat, few-shot template) at Poisson request
rates; a session's next turn waits for its previous one. Run it once against a server with prefix
caching on and once with it off (`--cache` labels the rows): the traffic is the same (seeded per
workload and rate, and different per rate, so a rate never finds the previous rate's prompts cached).

Per (workload, rate) one row is written to --out (rows of the same setup, cache, workload and rate are
replaced):
- hit_rate: prompt tokens the server did not compute (`usage.prompt_tokens_details.cached_tokens`) /
  prompt tokens; theoretical_reuse: the same for a perfect cache (benchmarks.prefix_workload);
  server_hit_rate_prefill / _decode: the workers' own counters over the row (`vllm:prefix_cache_*`
  on /metrics; a decode worker's hits are KV it did not need transferred);
- ttft_p50_ms / ttft_p99_ms / tpot_p50_ms, client-side; goodput_rps: requests meeting both SLOs per
  second of the run (DistServe's goodput), throughput_rps: completed requests per second;
- prefill_tokens_per_s: prompt tokens served per second; computed_prefill_tokens_per_s: those the
  server computed (prompt - cached);
- kv_transfer_bytes: KV moved prefill -> decode during the row (the gateway's `pdserve:kv_transfer_bytes`);
- server_ttft_parts_p50_ms: the server's own split of each request's TTFT (`/stats` request records:
  queue, prefill, transfer, the rest up to the first token at the gateway) and
  server_local_prefill_fraction: where a cached request's cost goes, and the fixed part of it.

`--cache uncached` measures the same traffic on the same server (caching on) with every prompt made
unique at its first token (an id no other prompt starts with, at the same length), so no block
matches: what the prompts cost without a hit, with no second server to start (the one-call GPU run);
`--cache off` labels a run against a server with caching off.

    python -m benchmarks.bench_prefix_cache --url http://127.0.0.1:8000 --setup one_gpu --cache on \
        --rates 4 --out loadtest/results/prefix_cache_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import socket
import time
from pathlib import Path

import httpx

from benchmarks.prefix_cache_report import check_summary
from benchmarks.prefix_workload import TOKEN_HI, TOKEN_LO, WorkloadRequest, few_shot, multi_turn, theoretical_reuse
from loadtest.report import percentile
from loadtest.server_stats import ServerStatsPoller, parse_counter_totals, summarize_requests

TRANSFER_BYTES = "pdserve:kv_transfer_bytes_total"
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
WORKLOADS = ("multi_turn", "few_shot")


async def one_request(client: httpx.AsyncClient, model: str, req: WorkloadRequest) -> dict:
    body = {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code, "prompt_tokens": len(req.prompt)}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    stamps.append(time.perf_counter())
                if ev.get("usage"):
                    usage = ev["usage"]
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return {"ok": False, "status": type(e).__name__, "prompt_tokens": len(req.prompt)}
    if not stamps:
        return {"ok": False, "status": "no tokens", "prompt_tokens": len(req.prompt)}
    ttft, n = stamps[0] - t0, len(stamps)
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ok": True, "ttft": ttft, "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0,
            "end": stamps[-1], "prompt_tokens": len(req.prompt), "cached_tokens": details.get("cached_tokens")}


async def run_workload(url: str, model: str, reqs: list[WorkloadRequest], rate: float, seed: int) -> tuple[list[dict], float]:
    """Sends `reqs` at Poisson arrivals (`rate` per second), each no earlier than its session's
    previous request finished. Returns (results in request order, seconds from first send to last token)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(rate)
    # TCP_NODELAY: see benchmarks.bench_e2e (Nagle would add up to ~200 ms to a TTFT).
    transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                                         limits=httpx.Limits(max_connections=4096, max_keepalive_connections=4096))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), transport=transport) as client:
        done: dict[tuple[int, int], asyncio.Event] = {(r.session, r.turn): asyncio.Event() for r in reqs}
        start = time.perf_counter()

        async def send(r: WorkloadRequest, at: float) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            prev = done.get((r.session, r.turn - 1))
            if prev is not None:
                await prev.wait()
            try:
                return await one_request(client, model, r)
            finally:
                done[(r.session, r.turn)].set()

        results = await asyncio.gather(*(send(r, a) for r, a in zip(reqs, arrivals)))
    ends = [x["end"] for x in results if x["ok"]]
    return list(results), (max(ends) - start) if ends else 0.0


def summarize(results: list[dict], elapsed: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r["ok"]]
    good = [r for r in ok if r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo]
    prompt = sum(r["prompt_tokens"] for r in ok)
    reported = [r for r in ok if r["cached_tokens"] is not None]
    cached = sum(r["cached_tokens"] for r in reported)
    per_s = (lambda x: x / elapsed) if elapsed > 0 else (lambda x: None)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "hit_rate": cached / sum(r["prompt_tokens"] for r in reported) if reported else None,
        "ttft_p50_ms": percentile([r["ttft"] * 1e3 for r in ok], 50),
        "ttft_p99_ms": percentile([r["ttft"] * 1e3 for r in ok], 99),
        "tpot_p50_ms": percentile([r["tpot"] * 1e3 for r in ok], 50),
        "goodput_rps": per_s(len(good)), "throughput_rps": per_s(len(ok)),
        "prefill_tokens_per_s": per_s(prompt),
        "computed_prefill_tokens_per_s": per_s(prompt - cached) if reported else None,
        "duration_s": elapsed,
    }


def build_workload(name: str, args, seed: int) -> list[WorkloadRequest]:
    if name == "multi_turn":
        return multi_turn(args.sessions, args.turns, args.system_tokens, output_tokens=args.output_tokens, seed=seed)
    if name == "few_shot":
        return few_shot(args.few_shot_requests, args.template_tokens, output_tokens=args.output_tokens, seed=seed)
    raise SystemExit(f"error: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def unshared(reqs: list[WorkloadRequest]) -> list[WorkloadRequest]:
    """The same requests, each prompt's first two tokens replaced by a pair no other prompt starts
    with, so no KV block of one matches another's (the lengths stay)."""
    span = TOKEN_HI - TOKEN_LO
    assert len(reqs) <= span * span, "more requests than distinct salts"
    return [dataclasses.replace(r, prompt=(TOKEN_LO + i // span, TOKEN_LO + i % span) + tuple(r.prompt[2:]))
            for i, r in enumerate(reqs)]


def server_counters(client: httpx.Client) -> dict[str, float]:
    """KV bytes moved and the prefix-cache counters per role, from the gateway's /metrics."""
    r = client.get("/metrics")
    text = r.text if r.status_code == 200 else ""
    out = {"bytes": parse_counter_totals(text, [TRANSFER_BYTES]).get(TRANSFER_BYTES, 0.0)}
    for role in ("prefill", "decode"):
        c = parse_counter_totals(text, [PREFIX_QUERIES, PREFIX_HITS], f'role="{role}"')
        out[f"{role}_queries"], out[f"{role}_hits"] = c.get(PREFIX_QUERIES, 0.0), c.get(PREFIX_HITS, 0.0)
    return out


def server_hit_rate(before: dict, after: dict, role: str) -> float | None:
    q = after[f"{role}_queries"] - before[f"{role}_queries"]
    return (after[f"{role}_hits"] - before[f"{role}_hits"]) / q if q > 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--setup", required=True, help="label, e.g. one_gpu or disaggregated")
    ap.add_argument("--cache", required=True, choices=["on", "off", "uncached"],
                    help="the server's enable_prefix_caching (on / off), or uncached: caching on, no prompt shares a block")
    ap.add_argument("--workloads", default="multi_turn,few_shot")
    ap.add_argument("--rates", default="4", help="request rates (requests/s), comma-separated")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--few-shot-requests", type=int, default=96)
    ap.add_argument("--template-tokens", type=int, default=1200)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="the server's KV block size (for the theory)")
    ap.add_argument("--ttft-slo-s", type=float, default=1.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="loadtest/results/prefix_cache_h200.json")
    args = ap.parse_args(argv)

    with httpx.Client(base_url=args.url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        # Warm-up on prompts no workload sends (first-call costs stay out of the rows).
        for i in range(3):
            asyncio.run(run_workload(args.url, model, few_shot(2, 64, output_tokens=8, seed=10_000 + i), 100.0, i))
        out = Path(args.out)
        doc = json.loads(out.read_text()) if out.is_file() else {"rows": []}
        rates = [float(x) for x in args.rates.split(",")]
        for wi, name in enumerate(args.workloads.split(",")):
            for ri, rate in enumerate(rates):
                seed = args.seed + 1000 * wi + ri
                reqs = build_workload(name, args, seed)
                if args.cache == "uncached":
                    reqs = unshared(reqs)
                hits, total = theoretical_reuse([r.prompt for r in reqs], args.block_size)
                before = server_counters(client)
                poller = ServerStatsPoller(args.url, interval_s=0.25).start()
                try:
                    results, elapsed = asyncio.run(run_workload(args.url, model, reqs, rate, seed))
                    time.sleep(0.5)  # the router polls the workers' counters every stats_interval_s
                finally:
                    poller.stop()
                after = server_counters(client)
                moved = after["bytes"] - before["bytes"]
                row = {"setup": args.setup, "cache": args.cache, "workload": name, "request_rate": rate,
                       **summarize(results, elapsed, args.ttft_slo_s, args.tpot_slo_s),
                       "theoretical_reuse": hits / total, "prompt_tokens": total,
                       "server_hit_rate_prefill": server_hit_rate(before, after, "prefill"),
                       "server_hit_rate_decode": server_hit_rate(before, after, "decode"),
                       "kv_transfer_bytes": moved, "kv_transfer_bytes_per_prompt_token": moved / total,
                       **{k: v for k, v in summarize_requests(poller.requests).items()
                          if k in ("server_requests", "server_ttft_p50_ms", "server_ttft_parts_p50_ms",
                                   "server_local_prefill_fraction")}}
                key = ("setup", "cache", "workload", "request_rate")
                doc["rows"] = [r for r in doc["rows"] if tuple(r.get(k) for k in key) != tuple(row[k] for k in key)]
                doc["rows"].append(row)
                doc.setdefault("config", {}).update(
                    {k: getattr(args, k) for k in ("sessions", "turns", "system_tokens", "few_shot_requests",
                                                    "template_tokens", "output_tokens", "block_size", "ttft_slo_s",
                                                    "tpot_slo_s")})
                doc["checks"] = check_summary(doc["rows"])  # the targets over every row so far (met / missed)
                print(json.dumps(row), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
