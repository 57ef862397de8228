"""Poisson load with mixed prompt lengths against a running `pdserve serve`: ITL, TTFT and goodput.

Goodput is counted as DistServe does: requests per second that meet both service-level objectives
(time to first token <= --ttft-slo-s and time per output token <= --tpot-slo-s). Run it once per
setup (disaggregated, colocated) and per request rate; rows are appended to --out.

    python -m loadtest.bench_disagg --url http://127.0.0.1:8000 --setup disaggregated \
        --rates 2,4,8 --duration 40 --out loadtest/results/disagg_vs_colocated.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from loadtest.report import percentile



async def one_request(client, model, prompt, max_tokens, stall_s):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    stamps = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return {"ok": False, "status": type(e).__name__}
    if not stamps:
        return {"ok": False, "status": "no tokens"}
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    latency = stamps[-1] - t0
    n = len(stamps)
    return {"ok": True, "ttft": stamps[0] - t0, "gaps": gaps, "latency": latency,
            "tpot": (latency - (stamps[0] - t0)) / (n - 1) if n > 1 else 0.0, "stalled": any(g > stall_s for g in gaps)}


async def run_rate(url, model, rate, duration, prompt_lens, output_tokens, seed, stall_s):
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        tasks = []
        t_end = time.perf_counter() + duration
        while time.perf_counter() < t_end:
            n = rng.choice(prompt_lens)
            prompt = [10 + rng.randrange(400) for _ in range(n)]
            tasks.append(asyncio.create_task(one_request(client, model, prompt, output_tokens, stall_s)))
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        return await asyncio.gather(*tasks)


def summarize(setup, rate, results, sent_for, ttft_slo, tpot_slo):
    ok = [r for r in results if r["ok"]]
    gaps_ms = [g * 1e3 for r in ok for g in r["gaps"]]
    good = [r for r in ok if r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo]
    return {
        "setup": setup, "request_rate": rate, "requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "stalled": sum(r["stalled"] for r in ok),
        "goodput_rps": len(good) / sent_for, "throughput_rps": len(ok) / sent_for,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "itl_p50_ms": percentile(gaps_ms, 50), "itl_p99_ms": percentile(gaps_ms, 99),
        "ttft_p50_ms": percentile([r["ttft"] * 1e3 for r in ok], 50), "ttft_p99_ms": percentile([r["ttft"] * 1e3 for r in ok], 99),
        "tpot_p50_ms": percentile([r["tpot"] * 1e3 for r in ok], 50),
        "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--setup", required=True, help="label of this run, e.g. disaggregated or colocated")
    ap.add_argument("--rates", default="1,2,4", help="request rates (requests/s), comma-separated")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--prompt-lens", default="128,512,2048", help="prompt lengths drawn uniformly")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--ttft-slo-s", type=float, default=1.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.05)
    ap.add_argument("--stall-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="loadtest/results/disagg_vs_colocated.json")
    args = ap.parse_args(argv)

    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    doc.setdefault("config", {}).update({"prompt_lens": lens, "output_tokens": args.output_tokens,
                                         "duration_s": args.duration, "ttft_slo_s": args.ttft_slo_s,
                                         "tpot_slo_s": args.tpot_slo_s})
    for rate in [float(x) for x in args.rates.split(",")]:
        results = asyncio.run(run_rate(args.url, model, rate, args.duration, lens, args.output_tokens,
                                       args.seed, args.stall_s))
        row = summarize(args.setup, rate, results, args.duration, args.ttft_slo_s, args.tpot_slo_s)
        doc["rows"] = [r for r in doc["rows"] if not (r["setup"] == args.setup and r["request_rate"] == rate)] + [row]
        print(json.dumps(row))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
