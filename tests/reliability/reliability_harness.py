"""Helpers of the reliability tests: a real cluster per module (real Ray actors, the real router and
gateway under uvicorn on 127.0.0.1, reached over HTTP), and the checks every test ends with: no KV
block leaked on any worker, no request left in the router, no stray asyncio task on the gateway."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import httpx

MODEL = "pdserve-demo"


def init_ray():
    """Starts Ray unless a caller (another test package's session fixture) already did; returns
    whether this call owns it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    return True


def start_cluster(demo_model_dir, **overrides):
    """The real launcher with the real prefill/decode actors on CPU."""
    from cluster.config import ClusterConfig
    from cluster.launch import ServingCluster

    settings = dict(model=str(demo_model_dir), served_model_name=MODEL, port=0, cpu_num_blocks=256, max_num_seqs=32,
                    use_cuda_graph=False, stats_interval_s=0.05, cpus_per_worker=1.0, device="cpu",
                    ready_timeout_s=120, prefill_workers=0, decode_workers=1)
    settings.update(overrides)
    sc = ServingCluster(ClusterConfig(**settings))
    sc.start_in_thread()
    wait_ready(sc.url)
    return sc


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready")


def worker_stats(sc, roles=("decode",)):
    import ray

    handles = {}
    if "decode" in roles:
        handles.update(sc.workers.decode)
    if "prefill" in roles:
        handles.update(sc.workers.prefill)
    alive = {}
    for wid, h in handles.items():
        try:
            alive[wid] = ray.get(h.stats.remote(), timeout=10)
        except Exception:  # a worker a test killed
            pass
    return alive


def wait_clean(sc, timeout_s: float = 20.0) -> dict:
    """Waits until every live worker (prefill and decode) holds no request and every KV block is back
    in its free pool, and the router holds no request; returns the workers' stats. Fails otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(sc, roles=("decode", "prefill"))
        clean = all(s.free_blocks == s.total_blocks and s.running == 0 and s.waiting == 0 for s in stats.values())
        router = sc.gateway.router
        if clean and not router.inflight and router.admission.num_admitted == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"not clean: workers {stats}, router inflight {list(router.inflight)}, "
                                 f"admitted {router.admission.num_admitted}")
        time.sleep(0.05)


def gateway_tasks(sc) -> list[str]:
    """Names of the asyncio tasks alive on the gateway's loop (besides the server's own)."""
    loop = sc.gateway.loop
    fut = asyncio.run_coroutine_threadsafe(_task_names(), loop)
    return fut.result(timeout=5)


async def _task_names() -> list[str]:
    me = asyncio.current_task()
    # Router._poll: the stats poll's own short-lived per-worker calls (gathered, never left behind).
    return sorted(name for t in asyncio.all_tasks() if t is not me
                  and (name := t.get_coro().__qualname__) != "Router._poll")


def rss_mb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def is_openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


async def stream_completion(client: httpx.AsyncClient, body: dict, stop_after: int | None = None):
    """POSTs a streaming completion; returns (status, text, events). With `stop_after`, closes the
    connection after that many data events (a client going away mid-stream)."""
    text, events = "", []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, events
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            ev = json.loads(line[6:])
            events.append(ev)
            if "choices" in ev and ev["choices"]:
                text += ev["choices"][0].get("text") or ""
            if stop_after is not None and len(events) >= stop_after:
                break
    return 200, text, events
