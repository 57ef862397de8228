"""Helpers of the reliability tests: a real cluster per module (real Ray actors, the real router and
gateway under uvicorn on 127.0.0.1, reached over HTTP), and the checks every test ends with: no KV
block leaked on any worker, no request left in the router, no stray asyncio task on the gateway."""

from __future__ import annotations

import asyncio
import json
import os

import httpx

from serving_harness import MODEL, init_ray, start_cluster as _start, wait_clean, wait_ready, worker_stats  # noqa: F401


def start_cluster(demo_model_dir, **overrides):
    """The real launcher with the real actors on CPU (by default every prompt prefilled on decode)."""
    return _start(demo_model_dir, **{"prefill_workers": 0, "decode_workers": 1, **overrides})


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
