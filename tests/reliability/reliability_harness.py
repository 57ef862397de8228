"""Helpers of the reliability tests: a real cluster per module (real Ray actors, the real router and
API-server processes under uvicorn on 127.0.0.1, reached over HTTP), and the checks every test ends
with: no KV block leaked on any worker, no request left in the router, no stray asyncio task or
token stream on any gateway."""

from __future__ import annotations

import json
import time

import httpx

from serving_harness import (MODEL, gateway_status, init_ray, start_cluster as _start, wait_clean, wait_ready,  # noqa: F401
                             worker_stats)


def start_cluster(demo_model_dir, **overrides):
    """The real launcher with the real actors on CPU (by default every prompt prefilled on decode)."""
    return _start(demo_model_dir, **{"prefill_workers": 0, "decode_workers": 1, **overrides})


def gateway_tasks(sc) -> dict[str, tuple[int, int]]:
    """Per API-server process: (asyncio tasks, open token streams), fresh from its heartbeat."""
    return gateway_status(sc)


def wait_gateways_settle(sc, before: dict, timeout_s: float = 10.0) -> dict:
    """Waits until every gateway holds as many tasks as `before` and no token stream; returns the last status."""
    deadline = time.monotonic() + timeout_s
    while (after := gateway_status(sc)) != before and time.monotonic() < deadline:
        pass
    return after


def api_server_pids(sc) -> list[int]:
    return [p.pid for p in sc.api_servers.procs]


def rss_mb(sc) -> float:
    """Resident memory of the gateways: the API-server processes together."""
    import psutil

    return sum(psutil.Process(pid).memory_info().rss for pid in api_server_pids(sc)) / 2**20


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
