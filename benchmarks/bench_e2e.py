"""End-to-end latency at batch 1 through HTTP, against the server's own step time.

Sends streaming completions one at a time (so the decode batch is 1), records each inter-token gap
as the client sees it, and reads the server's `/stats`: the decode step time of the batch-1 steps in
the same window and, per request, time to first token split into its parts. Writes a JSON with `itl_http_p50_ms`,
`server_step_ms`, `ttft_ms`, one `<part>_ms` per part of the TTFT (router.stats.step_stats.TTFTPoints) and `transfer_ms`.

    python -m benchmarks.bench_e2e --url http://127.0.0.1:8000 --out loadtest/results/e2e_h200.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from pathlib import Path

import httpx

from loadtest.report import percentile


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None



def stream_once(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Returns (TTFT seconds, inter-token gaps in seconds) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    stamps = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="loadtest/results/e2e_h200.json")
    args = ap.parse_args(argv)

    # TCP_NODELAY: httpx writes a POST's headers and body separately, and Nagle's algorithm then holds
    # the body until the server's delayed ACK (up to ~200 ms), which lands in the client's TTFT.
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    with httpx.Client(base_url=args.url, timeout=300, transport=transport) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        # Token ids 10.. avoid the tokenizer's special tokens; the prompt length is exact.
        prompts = [[10 + (i * 7 + j) % 400 for j in range(args.prompt_tokens)] for i in range(args.requests + args.warmup)]
        for p in prompts[: args.warmup]:
            stream_once(client, model, p, 16)
        start = time.time()
        ttfts, gaps = [], []
        for p in prompts[args.warmup :]:
            ttft, g = stream_once(client, model, p, args.max_tokens)
            ttfts.append(ttft)
            gaps.extend(g)
        stats = client.get("/stats", params={"since": start}).json()

    steps = [s["step_ms"] for s in stats["decode_steps"] if s["batch_size"] == 1]
    reqs = [r for r in stats["requests"] if r.get("ttft_ms") is not None]
    remote = [r for r in reqs if not r.get("local_prefill")]
    itl_ms = [g * 1e3 for g in gaps]
    out = {
        "url": args.url,
        "model": model,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "itl_http_p50_ms": _median(itl_ms),
        "itl_http_p90_ms": percentile(itl_ms, 90),
        "itl_http_p99_ms": percentile(itl_ms, 99),
        "server_step_ms": _median(steps),
        "server_steps": len(steps),
        "ttft_client_ms": _median([t * 1e3 for t in ttfts]),
        "ttft_ms": _median([r["ttft_ms"] for r in reqs]),
        # the TTFT's parts (router.stats.step_stats.TTFTPoints), each a median over the disaggregated requests
        **{f"{k}_ms": _median([r["ttft_parts_ms"][k] for r in remote])
           for k in (remote[0]["ttft_parts_ms"] if remote else ())},
        "transfer_ms": _median([r["transfer_ms"] for r in remote]),
        "disaggregated_requests": len(remote),
    }
    if out["itl_http_p50_ms"] and out["server_step_ms"]:
        out["itl_over_step"] = out["itl_http_p50_ms"] / out["server_step_ms"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for k, v in out.items():
        print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
