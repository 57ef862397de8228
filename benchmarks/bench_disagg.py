"""Poisson load with mixed prompt lengths against a running `pdserve serve`: goodput, TTFT and ITL per
request rate, for one setup (run it once per server setup: adaptive, static-1p1d, colocated).

Goodput is counted as DistServe does: requests per second of arrivals that met both service-level
objectives (time to first token <= TTFT SLO and time per output token <= TPOT SLO); every SLO set
given with --slo gets its own rows from the same requests. A 429 is counted apart (`rejected`), not
as a failure; `failed` is every other request that did not finish (an error, a broken stream, or
still unfinished --drain-s after the last arrival).

Before measuring, --warmup-requests requests of every prompt length run (not recorded): whatever the
server did not warm up itself would otherwise land on the first rate's tail. Every measured request
is written to --records (JSONL: send time, prompt length, status, TTFT, every inter-chunk gap, TPOT,
tokens) so that a tail can be traced to the requests that made it. Between rates the server's own
counters are read from /metrics (where prompts were prefilled, and why; the workers' measured pass
costs) and stored with the rows.

With --phases the load shifts instead (a server started with --planner): back-to-back phases of
Poisson arrivals, each its own rate and mix (name:rate:prompt_lens/...:output_tokens:seconds), while
/metrics is sampled every second for the planner's role switches and the healthy workers per role.
The result (doc["shift"][setup]) has goodput per phase and SLO set, per 10 s window, and for the
last phase before and after the first role switch (by send time: requests sent before the switch
counter moved, and after).

    python -m benchmarks.bench_disagg --url http://127.0.0.1:8000 --setup adaptive \\
        --rates 2,8,16 --out loadtest/results/disagg_vs_colocated.json
    python -m benchmarks.bench_disagg --url http://127.0.0.1:8000 --setup planner \\
        --phases prefill_heavy:4:2048:16:30,decode_heavy:12:128:256:120 --out ...
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

DEFAULT_SLOS = "loose:1.0:0.05,tight:0.3:0.015"  # name:ttft_s:tpot_s


def parse_slos(text: str) -> list[tuple[str, float, float]]:
    out = []
    for item in text.split(","):
        name, ttft, tpot = item.split(":")
        out.append((name, float(ttft), float(tpot)))
    return out


def duration_for(rate: float, duration: float, min_requests: int, max_duration: float) -> float:
    """Seconds of arrivals at `rate`: at least `duration` and long enough for `min_requests` arrivals
    (so the low rates have a tail to speak of), at most `max_duration`."""
    return min(max_duration, max(duration, min_requests / rate))


def rate_durations(rates: list[float], duration: float, min_requests: int, max_duration: float,
                   min_requests_lowest: int | None) -> dict[float, float]:
    """Seconds of arrivals per rate; the lowest rate runs until `min_requests_lowest` arrivals are
    expected even past max_duration (its TTFT tail is judged on them)."""
    out = {r: duration_for(r, duration, min_requests, max_duration) for r in rates}
    if rates and min_requests_lowest:
        low = min(rates)
        out[low] = max(out[low], min_requests_lowest / low)
    return out


def parse_phases(text: str) -> list[dict]:
    """name:rate:prompt_lens (slash-separated):output_tokens:seconds, comma-separated."""
    out = []
    for item in text.split(","):
        name, rate, lens, output, seconds = item.split(":")
        out.append({"name": name, "rate": float(rate), "prompt_lens": [int(x) for x in lens.split("/")],
                    "output_tokens": int(output), "seconds": float(seconds)})
    return out


async def one_request(client, model, prompt, max_tokens) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = None
    status: int | str = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code, "t_send": t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    stamps.append(now)
                elif ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                elif "error" in ev:
                    return {"ok": False, "status": "error event", "t_send": t0}
    except asyncio.CancelledError:
        return {"ok": False, "status": "unfinished", "t_send": t0, "chunks": len(stamps)}
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return {"ok": False, "status": type(e).__name__, "t_send": t0}
    if not stamps:
        return {"ok": False, "status": f"{status}: no tokens", "t_send": t0}
    tokens = tokens or len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    ttft = stamps[0] - t0
    latency = stamps[-1] - t0
    return {"ok": True, "status": 200, "t_send": t0, "ttft": ttft, "gaps": gaps, "latency": latency,
            "tokens": tokens, "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else 0.0}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [10 + rng.randrange(400) for _ in range(n)]


async def run_rate(url, model, rate, duration, prompt_lens, output_tokens, seed, drain_s) -> list[dict]:
    """Poisson arrivals for `duration` s; then waits up to `drain_s` for what is still running and
    gives up on the rest (recorded as unfinished)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=8192, max_keepalive_connections=8192)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        tasks, meta = [], []
        start = time.perf_counter()
        t_next = start
        while t_next < start + duration:
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            n = rng.choice(prompt_lens)
            meta.append({"prompt_tokens": n, "scheduled_s": round(t_next - start, 4)})
            tasks.append(asyncio.create_task(one_request(client, model, _prompt(rng, n), output_tokens)))
            t_next += rng.expovariate(rate)  # Poisson arrivals, on a fixed schedule (no drift)
        done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        results = await asyncio.gather(*tasks)
    for r, m in zip(results, meta):
        r.update(m)
        r["sent_s"] = round(r.pop("t_send") - start, 4)
    return results


async def warm_up(url, model, prompt_lens, output_tokens, per_length, seed) -> None:
    rng = random.Random(seed + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30)) as client:
        for _ in range(per_length):
            await asyncio.gather(*(one_request(client, model, _prompt(rng, n), min(output_tokens, 16))
                                   for n in prompt_lens))


def summarize(setup, rate, results, sent_for, slo) -> dict:
    name, ttft_slo, tpot_slo = slo
    ok = [r for r in results if r["ok"]]
    rejected = sum(1 for r in results if r.get("status") == 429)
    gaps_ms = [g * 1e3 for r in ok for g in r["gaps"]]
    good = [r for r in ok if r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo]
    ttfts = [r["ttft"] * 1e3 for r in ok]

    def rnd(x, nd=2):
        return None if x is None else round(x, nd)
    return {
        "setup": setup, "slo": name, "request_rate": rate, "goodput_rps": round(len(good) / sent_for, 3),
        "itl_p50_ms": rnd(percentile(gaps_ms, 50)), "itl_p99_ms": rnd(percentile(gaps_ms, 99)),
        "ttft_p50_ms": rnd(percentile(ttfts, 50)), "ttft_p99_ms": rnd(percentile(ttfts, 99)),
        "failed": len(results) - len(ok) - rejected, "rejected": rejected,
        "requests": len(results), "completed": len(ok), "slo_attainment": round(len(good) / len(results), 4) if results else 0.0,
        "unfinished": sum(1 for r in results if r.get("status") == "unfinished"),
        "throughput_rps": round(len(ok) / sent_for, 3),
        "tpot_p50_ms": rnd(percentile([r["tpot"] * 1e3 for r in ok], 50)),
        "tpot_p99_ms": rnd(percentile([r["tpot"] * 1e3 for r in ok], 99)),
        "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "duration_s": round(sent_for, 2),
    }


def server_counters(url: str) -> dict:
    """From /metrics: prompts prefilled locally/remotely (by reason), 429s, the workers' pass costs."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict = {"placements": {}, "pass_cost": {}}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        labels = dict(kv.split("=", 1) for kv in name[name.find("{") + 1:name.rfind("}")].split(",") if "=" in kv)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if name.startswith("pdserve:prefill_placements_total"):
            out["placements"][f"{labels['where']}/{labels['reason']}"] = float(value)
        elif name.startswith("pdserve:worker_pass_cost_seconds"):
            out["pass_cost"][f"{labels['worker_id']}/{labels['pass']}/{labels['term']}"] = float(value)
        elif name.startswith("pdserve:request_rejected_total"):
            out.setdefault("rejected", {})[labels.get("status", "?")] = float(value)
    return out


def planner_sample(url: str) -> dict:
    """From /metrics: role switches so far, and the healthy workers per role."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    switches, roles = 0.0, {}
    for line in text.splitlines():
        if line.startswith("pdserve:worker_role_switches_total"):
            switches = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve:worker_healthy{") and line.rsplit(" ", 1)[1] == "1.0":
            role = line.split('role="', 1)[1].split('"', 1)[0]
            roles[role] = roles.get(role, 0) + 1
    return {"role_switches": switches, "healthy": roles}


async def run_phases(url, model, phases, seed, drain_s, poll_s=1.0) -> tuple[list[dict], list[dict]]:
    """The phases back to back on one schedule (a phase's requests may still run in the next); the
    /metrics samples taken meanwhile, with their time from the start."""
    rng = random.Random(seed)
    samples: list[dict] = []
    limits = httpx.Limits(max_connections=8192, max_keepalive_connections=8192)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        start = time.perf_counter()
        stop = asyncio.Event()

        async def poll():
            while not stop.is_set():
                sample = await asyncio.to_thread(planner_sample, url)
                samples.append({"t_s": round(time.perf_counter() - start, 3), **sample})
                try:
                    await asyncio.wait_for(stop.wait(), poll_s)
                except asyncio.TimeoutError:
                    pass
        poller = asyncio.create_task(poll())
        tasks, meta, t_next, t0 = [], [], start, start
        for ph in phases:
            t_end = t0 + ph["seconds"]
            t_next = max(t_next, t0)
            while t_next < t_end:
                delay = t_next - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                n = rng.choice(ph["prompt_lens"])
                meta.append({"phase": ph["name"], "prompt_tokens": n, "scheduled_s": round(t_next - start, 4)})
                tasks.append(asyncio.create_task(one_request(client, model, _prompt(rng, n), ph["output_tokens"])))
                t_next += rng.expovariate(ph["rate"])
            t0 = t_end
        done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        results = await asyncio.gather(*tasks)
        stop.set()
        await poller
    for r, m in zip(results, meta):
        r.update(m)
        r["sent_s"] = round(r.pop("t_send") - start, 4)
    return results, samples


def summarize_shift(setup: str, phases: list[dict], results: list[dict], samples: list[dict], slos,
                    window_s: float = 10.0) -> dict:
    """Goodput per phase, per window, and around the first role switch (see the module docstring)."""
    out: dict = {"setup": setup, "phases": phases, "samples": samples, "per_phase": [], "windows": []}
    for ph in phases:
        rs = [r for r in results if r["phase"] == ph["name"]]
        out["per_phase"] += [{"phase": ph["name"], **summarize(setup, ph["rate"], rs, ph["seconds"], slo)} for slo in slos]
    total = sum(ph["seconds"] for ph in phases)
    for k in range(int(-(-total // window_s))):
        lo, hi = k * window_s, min(total, (k + 1) * window_s)
        rs = [r for r in results if lo <= r["sent_s"] < hi]
        if rs and hi > lo:
            out["windows"] += [{"t0_s": lo, "t1_s": hi, **summarize(setup, len(rs) / (hi - lo), rs, hi - lo, slo)}
                               for slo in slos]
    base = samples[0]["role_switches"] if samples and "role_switches" in samples[0] else 0.0
    moved = [s for s in samples if s.get("role_switches", base) > base]
    out["first_switch_s"] = moved[0]["t_s"] if moved else None
    if moved:
        last = phases[-1]
        t_last = sum(ph["seconds"] for ph in phases[:-1])
        rs = [r for r in results if r["phase"] == last["name"]]
        before = [r for r in rs if r["sent_s"] < moved[0]["t_s"]]
        after = [r for r in rs if r["sent_s"] >= moved[0]["t_s"]]
        span_before = max(1e-9, min(moved[0]["t_s"], t_last + last["seconds"]) - t_last)
        span_after = max(1e-9, t_last + last["seconds"] - moved[0]["t_s"])
        out["around_switch"] = [{"when": "before", **summarize(setup, last["rate"], before, span_before, slo)}
                                for slo in slos] + \
                               [{"when": "after", **summarize(setup, last["rate"], after, span_after, slo)}
                                for slo in slos]
        out["healthy_before"], out["healthy_after"] = samples[0].get("healthy"), moved[-1].get("healthy")
    return out


def _diff(after: dict, before: dict) -> dict:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0)}


def evaluate_targets(rows: list[dict], candidate: str = "adaptive", baseline: str = "colocated") -> dict:
    """The issue's targets, reported (not asserted): candidate goodput >= baseline at every rate under
    every SLO set; >= 1.3x baseline at the highest rate where the baseline met 90 % of its requests
    under the tightest SLO set; candidate TTFT p99 <= 3x its p50 at the lowest rate; no failed request
    below saturation (rates where the candidate served >= 90 % of arrivals)."""
    by = {(r["setup"], r["slo"], r["request_rate"]): r for r in rows}
    slos = sorted({r["slo"] for r in rows}, key=lambda s: min(r["ttft_slo_s"] for r in rows if r["slo"] == s))
    rates = sorted({r["request_rate"] for r in rows})
    out: dict = {"candidate": candidate, "baseline": baseline, "goodput_ge_baseline": {}}
    for slo in slos:
        pairs = [(by.get((candidate, slo, x)), by.get((baseline, slo, x))) for x in rates]
        out["goodput_ge_baseline"][slo] = {str(x): (c["goodput_rps"] >= b["goodput_rps"]) if c and b else None
                                           for x, (c, b) in zip(rates, pairs)}
    if slos:
        tight = slos[0]
        ok_rates = [x for x in rates if (b := by.get((baseline, tight, x))) and b["slo_attainment"] >= 0.9]
        if ok_rates:
            x = max(ok_rates)
            c, b = by.get((candidate, tight, x)), by[(baseline, tight, x)]
            out["tight_slo_rate"] = x
            out["tight_slo_goodput_ratio"] = round(c["goodput_rps"] / b["goodput_rps"], 3) if c and b["goodput_rps"] else None
        low = by.get((candidate, slos[-1], rates[0])) if rates else None
        if low and low["ttft_p50_ms"]:
            out["low_rate_ttft_p99_over_p50"] = round(low["ttft_p99_ms"] / low["ttft_p50_ms"], 3)
        below = [by[(candidate, slos[-1], x)] for x in rates if (candidate, slos[-1], x) in by
                 and by[(candidate, slos[-1], x)]["completed"] >= 0.9 * by[(candidate, slos[-1], x)]["requests"]]
        out["failed_below_saturation"] = sum(r["failed"] for r in below)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--setup", required=True, help="label of this server setup: adaptive, static-1p1d, colocated")
    ap.add_argument("--rates", default="2,8,16,24,32,48", help="request rates (requests/s), comma-separated")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per rate (at least)")
    ap.add_argument("--min-requests", type=int, default=30, help="low rates run until this many arrivals")
    ap.add_argument("--min-requests-lowest", type=int, default=None,
                    help="the lowest rate runs until this many arrivals, even past --max-duration")
    ap.add_argument("--max-duration", type=float, default=15.0, help="seconds of arrivals per rate (at most)")
    ap.add_argument("--drain-s", type=float, default=8.0,
                    help="after the last arrival, how long running requests may take before they count as unfinished")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause between rates")
    ap.add_argument("--prompt-lens", default="128,512,2048", help="prompt lengths drawn uniformly")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--slo", default=DEFAULT_SLOS, help="SLO sets name:ttft_s:tpot_s, comma-separated")
    ap.add_argument("--warmup-requests", type=int, default=2, help="unrecorded requests per prompt length first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="loadtest/results/disagg_vs_colocated.json")
    ap.add_argument("--records", default=None, help="per-request JSONL (default: <out stem>_records.jsonl)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="wall-clock time (epoch s) by which to be done: a rate that could not finish by then is skipped")
    ap.add_argument("--phases", default=None,
                    help="load shift instead of rates: name:rate:prompt_lens (a/b):output_tokens:seconds, comma-separated")
    args = ap.parse_args(argv)

    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    slos = parse_slos(args.slo)
    out = Path(args.out)
    records = Path(args.records) if args.records else out.with_name(out.stem + "_records.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    doc.setdefault("config", {}).update({
        "prompt_lens": lens, "output_tokens": args.output_tokens, "duration_s": args.duration,
        "min_requests": args.min_requests, "max_duration_s": args.max_duration, "drain_s": args.drain_s,
        "slos": {n: {"ttft_s": a, "tpot_s": b} for n, a, b in slos}, "warmup_requests": args.warmup_requests})
    server = doc.setdefault("server", {})

    t0 = time.perf_counter()
    if args.phases:
        phases = parse_phases(args.phases)
        lens = sorted({n for ph in phases for n in ph["prompt_lens"]})
    asyncio.run(warm_up(args.url, model, lens, args.output_tokens, args.warmup_requests, args.seed))
    print(f"[{args.setup}] warm-up: {args.warmup_requests} x {lens} in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.phases:
        results, samples = asyncio.run(run_phases(args.url, model, phases, args.seed, args.drain_s))
        with open(records, "a") as f:
            for i, r in enumerate(results):
                f.write(json.dumps({"setup": args.setup, "i": i, **{k: v for k, v in r.items() if k != "gaps"}}) + "\n")
        shift = summarize_shift(args.setup, phases, results, samples, slos)
        doc.setdefault("shift", {})[args.setup] = shift
        for row in shift["per_phase"] + shift.get("around_switch", []):
            print(json.dumps(row), flush=True)
        print(f"[{args.setup}] first role switch at {shift['first_switch_s']} s", flush=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    rates = [float(x) for x in args.rates.split(",")]
    durations = rate_durations(rates, args.duration, args.min_requests, args.max_duration, args.min_requests_lowest)
    for rate in rates:
        dur = durations[rate]
        if args.deadline is not None and time.time() + dur + args.drain_s > args.deadline:
            doc.setdefault("skipped", []).append({"setup": args.setup, "request_rate": rate, "why": "time budget"})
            print(f"[{args.setup}] {rate:g} req/s: skipped (time budget)", flush=True)
            continue
        before = server_counters(args.url)
        results = asyncio.run(run_rate(args.url, model, rate, dur, lens, args.output_tokens, args.seed, args.drain_s))
        after = server_counters(args.url)
        with open(records, "a") as f:
            for i, r in enumerate(results):
                rec = {"setup": args.setup, "request_rate": rate, "i": i, **r}
                if "gaps" in rec:
                    rec["itl_ms"] = [round(g * 1e3, 3) for g in rec.pop("gaps")]
                for k in ("ttft", "latency", "tpot"):
                    if k in rec:
                        rec[f"{k}_ms"] = round(rec.pop(k) * 1e3, 3)
                f.write(json.dumps(rec) + "\n")
        rows = [summarize(args.setup, rate, results, dur, slo) for slo in slos]
        doc["rows"] = [r for r in doc["rows"] if not (r["setup"] == args.setup and r["request_rate"] == rate)] + rows
        server.setdefault(args.setup, {})[str(rate)] = {
            "placements": _diff(after.get("placements", {}), before.get("placements", {})),
            "rejected": _diff(after.get("rejected", {}), before.get("rejected", {})),
            "pass_cost": after.get("pass_cost", {})}
        for row in rows:
            print(json.dumps(row), flush=True)
        print(f"[{args.setup}] {rate:g} req/s: placements {server[args.setup][str(rate)]['placements']}", flush=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        time.sleep(args.settle_s)
    doc["targets"] = evaluate_targets(doc["rows"])
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
