"""Chaos under load: greedy streams kept going while a fault injector kills a random prefill or decode
worker's process every few seconds (`ray.kill(no_restart=False)`: Ray restarts its actor, which
rejoins). Writes one JSON file of figures; RELIABILITY.md has them as a table.

    python -m loadtest.chaos --duration-s 300 --interval-s 10 --out loadtest/results/chaos_cpu.json

What it checks (and counts):
- every request ends within `--deadline-s` (else: hung), with HTTP 200 (else: an HTTP error; any 5xx
  counts separately) and no error event, and its text equals the reference engine's greedy text;
- per fault: the requests the router had on the victim when it was killed (affected), how many of
  those finished exactly, hung or got an error; seconds until the router had the restarted worker
  healthy again (its KV capacity back);
- after the load: seconds until every live worker holds every KV block free again (full capacity),
  and the blocks still held after `--settle-s` (leaked), plus each worker's block accounting check.

The injector keeps one decode worker healthy (it kills a decode worker only while another one is
healthy): new requests get 503 while no decode worker is healthy, which is the admission rule, not a
failure of the restarts under test. Runs the cluster in-process (the router on a thread, as the
tests do) to see the router's view of who holds what; on CPU with the demo model by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

MODEL = "pdserve-demo"


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt: int
    request_id: str | None = None
    status: int = 0
    text: str = ""
    error: str | None = None
    hung: bool = False
    exact: bool = False
    start: float = 0.0
    end: float = 0.0


@dataclass
class Fault:
    t: float  # seconds since the load started
    kind: str  # the victim's role: "prefill" | "decode"
    worker: str
    affected: list[str] = field(default_factory=list)  # request ids the router had on it
    back_s: float | None = None  # kill -> the router has it healthy again
    in_transfer: int = 0  # of those, remote prefills not landed yet: KV on the wire or being computed


def prompts(n: int, long_words: int = 30) -> list[str]:
    """Short prompts (prefilled on their decode worker) and long ones (prefilled remotely), alternating."""
    return [f"Chaos {i}: " + " ".join(f"w{(i * 7 + k) % 50}" for k in range(4 if i % 2 else long_words))
            for i in range(n)]


async def _one(client: httpx.AsyncClient, i: int, prompt: str, ref: str, max_tokens: int, deadline_s: float) -> Outcome:
    o = Outcome(i, start=time.monotonic())
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                o.status = r.status_code
                if r.status_code != 200:
                    o.error = (await r.aread()).decode(errors="replace")[:200]
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        ev = json.loads(line[6:])
                        o.request_id = o.request_id or ev.get("id")
                        if "error" in ev:
                            o.error = ev["error"].get("message", str(ev["error"]))
                        elif ev.get("choices"):
                            o.text += ev["choices"][0].get("text") or ""
    except TimeoutError:
        o.hung = True
    except httpx.HTTPError as e:
        o.error = f"{type(e).__name__}: {e}"
    o.end = time.monotonic()
    o.exact = o.status == 200 and o.error is None and not o.hung and o.text == ref
    return o


async def run_load(sc, refs: dict[str, str], *, duration_s: float, interval_s: float, streams: int,
                   max_tokens: int, deadline_s: float, seed: int = 0,
                   sole_decode_kills: bool = False) -> tuple[list[Outcome], list[Fault]]:
    """`streams` clients each send one greedy request after another for `duration_s` while a fault
    is injected every `interval_s`; returns every request's outcome and every fault.
    sole_decode_kills: a decode worker may be killed while it is the only healthy one (a 1P+1D
    cluster on two GPUs): its requests wait for its restart, and new ones get 503 meanwhile."""
    import ray

    rng = random.Random(seed)
    router = sc.router
    texts = list(refs)
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    t0 = time.monotonic()
    stop = t0 + duration_s

    async def client_loop(k: int, client: httpx.AsyncClient):
        i = k
        while time.monotonic() < stop:
            p = texts[i % len(texts)]
            outcomes.append(await _one(client, i % len(texts), p, refs[p], max_tokens, deadline_s))
            i += streams

    async def watch_back(f: Fault, killed_at: float, old: str | None):
        # Back: the router has the new incarnation rejoined and healthy (its KV blocks placeable again).
        while router.incarnation(f.worker) == old or not router.views[f.worker].healthy:
            await asyncio.sleep(0.05)
        f.back_s = time.monotonic() - killed_at

    async def injector():
        watchers = []
        while True:
            await asyncio.sleep(interval_s)
            if time.monotonic() >= stop:
                break
            healthy_decode = [w for w in router.decode_ids if router.views[w].healthy]
            kinds = [k for k, ok in (("prefill", any(router.views[w].healthy for w in router.prefill_ids)),
                                     ("decode", len(healthy_decode) >= (1 if sole_decode_kills else 2))) if ok]
            if not kinds:
                continue
            kind = rng.choice(kinds)
            ids = router.prefill_ids if kind == "prefill" else router.decode_ids
            wid = rng.choice([w for w in ids if router.views[w].healthy])
            held = sorted(router.views[wid].inflight)
            placed = [router.inflight.get(r) for r in held]
            f = Fault(round(time.monotonic() - t0, 2), kind, wid, held,
                      in_transfer=sum(1 for rs in placed if rs is not None and not rs.local_prefill and not rs.prefill_done))
            h = (sc.workers.prefill if kind == "prefill" else sc.workers.decode)[wid]
            old = router.incarnation(wid)
            ray.kill(h, no_restart=False)
            faults.append(f)
            logging.getLogger("chaos").warning("t=%.1fs killed %s holding %d requests", f.t, wid, len(f.affected))
            watchers.append(asyncio.ensure_future(watch_back(f, time.monotonic(), old)))
        return watchers

    async with httpx.AsyncClient(base_url=sc.url, timeout=None, limits=httpx.Limits(max_connections=streams + 8)) as c:
        inj = asyncio.ensure_future(injector())
        await asyncio.gather(*(client_loop(k, c) for k in range(streams)))
        watchers = await inj
        if watchers:  # every victim back (bounded: a worker that never returns is reported as such)
            await asyncio.wait(watchers, timeout=deadline_s)
            for w in watchers:
                w.cancel()
    return outcomes, faults


def settle(sc, timeout_s: float) -> tuple[float | None, dict[str, int]]:
    """Waits until every worker answers with all its KV blocks free and nothing running; returns the
    seconds that took (None: not within `timeout_s`) and the blocks each worker still held at the end."""
    import ray

    t0 = time.monotonic()
    handles = {**sc.workers.prefill, **sc.workers.decode}
    while True:
        held = {}
        for wid, h in handles.items():
            try:
                s = ray.get(h.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - not back yet
                held[wid] = -1
                continue
            held[wid] = s.total_blocks - s.free_blocks + s.running + s.waiting
        if all(v == 0 for v in held.values()):
            ray.get([h.check_blocks.remote() for h in handles.values()], timeout=30)
            return time.monotonic() - t0, held
        if time.monotonic() - t0 > timeout_s:
            return None, held
        time.sleep(0.1)


def summarize(outcomes: list[Outcome], faults: list[Fault], settle_s: float | None, held: dict[str, int]) -> dict:
    by_id = {o.request_id: o for o in outcomes if o.request_id}
    kinds = {}
    for kind in ("prefill", "decode"):
        fs = [f for f in faults if f.kind == kind]
        affected = [by_id[r] for f in fs for r in f.affected if r in by_id]
        backs = [f.back_s for f in fs if f.back_s is not None]
        kinds[kind] = dict(
            injected=len(fs), requests_affected=sum(len(f.affected) for f in fs),
            with_kv_in_flight=sum(f.in_transfer for f in fs), kills_mid_transfer=sum(f.in_transfer > 0 for f in fs),
            finished_exactly=sum(o.exact for o in affected), hung=sum(o.hung for o in affected),
            errors_returned=sum(o.error is not None for o in affected),
            not_back=sum(f.back_s is None for f in fs),
            seconds_to_full_capacity_max=round(max(backs), 2) if backs else None,
            seconds_to_full_capacity_mean=round(sum(backs) / len(backs), 2) if backs else None)
    leaked = sum(v for v in held.values() if v > 0)
    return dict(
        requests=len(outcomes), finished_exactly=sum(o.exact for o in outcomes),
        mismatched=sum(o.status == 200 and o.error is None and not o.hung and not o.exact for o in outcomes),
        hung=sum(o.hung for o in outcomes), errors_returned=sum(o.error is not None for o in outcomes),
        http_5xx=sum(o.status >= 500 for o in outcomes), http_4xx=sum(400 <= o.status < 500 for o in outcomes),
        blocks_leaked=leaked, workers_not_answering=[w for w, v in held.items() if v < 0],
        seconds_to_full_capacity_after_load=None if settle_s is None else round(settle_s, 2),
        by_fault=kinds)


def run(sc, engine, *, duration_s: float, interval_s: float, streams: int = 8, max_tokens: int = 24,
        deadline_s: float = 120.0, settle_s: float = 120.0, n_prompts: int = 16, seed: int = 0,
        long_words: int = 30, sole_decode_kills: bool = False) -> dict:
    """The whole experiment on a started cluster `sc` (ServingCluster, router in-process) against the
    reference `engine` (cluster.engine.LLMEngine on the same checkpoint)."""
    from cluster.sampling_params import SamplingParams

    ps = prompts(n_prompts, long_words)
    refs = {p: r.text for p, r in zip(ps, engine.generate(
        ps, [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * len(ps)))}
    t0 = time.monotonic()
    outcomes, faults = asyncio.run(run_load(sc, refs, duration_s=duration_s, interval_s=interval_s,
                                            streams=streams, max_tokens=max_tokens, deadline_s=deadline_s, seed=seed,
                                            sole_decode_kills=sole_decode_kills))
    load_s = time.monotonic() - t0
    took, held = settle(sc, settle_s)
    summary = summarize(outcomes, faults, took, held)
    bad = [asdict(o) for o in outcomes if not o.exact][:20]
    return dict(config=dict(duration_s=duration_s, interval_s=interval_s, streams=streams, max_tokens=max_tokens,
                            deadline_s=deadline_s, seed=seed, long_words=long_words,
                            sole_decode_kills=sole_decode_kills, device=sc.cfg.device,
                            kv_transport=sc.cfg.kv_transport, prefill_workers=len(sc.workers.prefill),
                            decode_workers=len(sc.workers.decode), worker_max_restarts=sc.cfg.worker_max_restarts),
                load_s=round(load_s, 1), summary=summary, faults=[asdict(f) for f in faults], not_exact=bad)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=300.0, help="how long the load and the faults run")
    ap.add_argument("--interval-s", type=float, default=10.0, help="seconds between two kills")
    ap.add_argument("--streams", type=int, default=8, help="concurrent greedy streams")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="a request still running after this hung")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    ap.add_argument("--gpus-per-worker", type=float, default=None, help="1: each worker its own GPU (KV over NCCL)")
    ap.add_argument("--kv-memory-fraction", type=float, default=0.5)
    ap.add_argument("--long-prompt-words", type=int, default=30,
                    help="words of the long prompts (prefilled remotely; long ones ship layer-wise)")
    ap.add_argument("--sole-decode-kills", action="store_true",
                    help="kill a decode worker even when it is the only healthy one (1P+1D on two GPUs)")
    ap.add_argument("--reference-device", default="cpu", help="where the reference engine runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import ray

    from deploy.config import ClusterConfig
    from deploy.serving_cluster import ServingCluster
    from cluster.engine import LLMEngine
    from cluster.model.demo import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    gpu = {} if args.device == "cpu" else {"gpus_per_worker": args.gpus_per_worker,
                                             "kv_memory_fraction": args.kv_memory_fraction}
    cfg = ClusterConfig(model=model, served_model_name=MODEL, port=0, device=args.device, dtype=args.dtype, **gpu,
                        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                        cpu_num_blocks=128, max_num_seqs=32, use_cuda_graph=args.device != "cpu",
                        stats_interval_s=0.05, cpus_per_worker=1.0, api_servers=1, ready_timeout_s=300,
                        prefill_placement="static", local_prefill_threshold=10, max_prefill_queue_s=1e9,
                        worker_max_restarts=-1)
    sc = ServingCluster(cfg)
    try:
        sc.start_in_thread(timeout_s=300)
        # The workers' greedy text must equal this engine's (same checkpoint and dtype).
        engine = LLMEngine(model, num_blocks=1024, max_num_seqs=64, dtype=args.dtype, device=args.reference_device)
        result = run(sc, engine, duration_s=args.duration_s, interval_s=args.interval_s, streams=args.streams,
                     max_tokens=args.max_tokens, deadline_s=args.deadline_s, seed=args.seed,
                     long_words=args.long_prompt_words, sole_decode_kills=args.sole_decode_kills)
    finally:
        sc.shutdown()
        ray.shutdown()
    result["command"] = "python -m loadtest.chaos " + " ".join(sys.argv[1:] if argv is None else argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
