"""Soak: mixed load of PDSERVE_SOAK_REQUESTS requests (default 240, 30 per client) on the demo model
with a prefill and a decode worker; PDSERVE_SOAK_S=N makes it N seconds of load instead (RELIABILITY.md's
figures come from a 300 s run: `PDSERVE_SOAK_S=300 python -m pytest -s tests/reliability/test_soak.py`):
short prompts (prefilled on the decode worker) and long ones (KV over gloo), streaming and not,
clients that go away mid-stream or before the answer. At the end no KV block, request, token-stream
queue or asyncio task is left, and the gateway's resident memory after warm-up (the first 30 % of the
requests) stays flat (bounded growth)."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from reliability_harness import MODEL, gateway_tasks, rss_mb, start_cluster, stream_completion, wait_clean, wait_gateways_settle

SOAK_S = float(os.environ["PDSERVE_SOAK_S"]) if os.environ.get("PDSERVE_SOAK_S") else None
SOAK_REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "240"))
CONCURRENCY = 8
WARMUP_FRACTION = 0.3


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=1, local_prefill_threshold=16,
                       cpu_num_blocks=256, max_waiting_requests=32)
    yield sc
    sc.shutdown()


def _another(load: dict, deadline: float | None) -> bool:
    """Whether to send another request: until SOAK_REQUESTS were sent (with PDSERVE_SOAK_S: until the
    deadline)."""
    if deadline is not None:
        return time.monotonic() < deadline
    load["sent"] += 1
    return load["sent"] <= SOAK_REQUESTS


async def _client_loop(url: str, seed: int, deadline: float | None, counts: dict, load: dict) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        i = 0
        while _another(load, deadline):
            i += 1
            words = rng.choice([2, 6, 12, 40, 150])
            body = {"model": MODEL, "prompt": " ".join(f"w{(seed * 31 + i + k) % 60}" for k in range(words)),
                    "max_tokens": rng.choice([4, 16, 48, 128]), "temperature": rng.choice([0, 0.7]),
                    "ignore_eos": rng.random() < 0.5}
            kind = rng.choice(["stream", "stream", "plain", "plain", "cut", "cancel"])
            try:
                if kind == "stream":
                    status, _, _ = await stream_completion(client, body)
                elif kind == "plain":
                    status = (await client.post("/v1/completions", json=body)).status_code
                elif kind == "cut":
                    status, _, _ = await stream_completion(client, body, stop_after=rng.randint(1, 8))
                    status = "cut"
                else:
                    await asyncio.wait_for(client.post("/v1/completions", json=body), rng.uniform(0.01, 0.5))
                    status = 200
            except asyncio.TimeoutError:
                status = "cancelled"
            counts[status] = counts.get(status, 0) + 1
            load["done"] += 1


def test_soak_mixed_load(cluster):
    tasks_before = gateway_tasks(cluster)
    counts: dict = {}
    load = {"sent": 0, "done": 0}
    rss: list[tuple[float, float]] = []  # (fraction of the load done, MiB), every second and at the end

    def done(t0: float) -> float:
        return (time.monotonic() - t0) / SOAK_S if SOAK_S else load["done"] / SOAK_REQUESTS

    async def sample_rss(t0: float, clients: asyncio.Future):
        while not clients.done():
            rss.append((done(t0), rss_mb(cluster)))
            await asyncio.wait([clients], timeout=1.0)
        rss.append((done(t0), rss_mb(cluster)))

    async def main():
        t0 = time.monotonic()
        deadline = t0 + SOAK_S if SOAK_S else None
        clients = asyncio.gather(*(_client_loop(cluster.url, s, deadline, counts, load) for s in range(CONCURRENCY)))
        # A failure bound only: the load ends when its requests (or PDSERVE_SOAK_S) are done.
        await asyncio.wait_for(asyncio.gather(sample_rss(t0, clients), clients), timeout=(SOAK_S or 240) + 90)
        return t0

    t0 = asyncio.run(main())
    elapsed = time.monotonic() - t0
    stats = wait_clean(cluster, timeout_s=30)
    warm = [m for fraction, m in rss if fraction >= WARMUP_FRACTION]
    growth = warm[-1] - warm[0]
    total = sum(counts.values())
    assert SOAK_S or total == SOAK_REQUESTS, (total, load)
    print(f"\nsoak {elapsed:.0f}s: {total} requests ({total / elapsed:.1f}/s), outcomes {sorted(counts.items(), key=str)}; "
          f"gateway RSS {rss[0][1]:.0f} -> {warm[0]:.0f} (after warm-up) -> {warm[-1]:.0f} MiB; "
          f"blocks free {', '.join(f'{w} {s.free_blocks}/{s.total_blocks}' for w, s in stats.items())}")
    assert counts.get(200, 0) > 0 and set(counts) <= {200, 429, "cut", "cancelled"}, counts
    assert all(s.free_blocks == s.total_blocks for s in stats.values())
    router = cluster.router
    assert not router.inflight and router.admission.num_admitted == 0 and router.admission.inflight_tokens == 0
    after = wait_gateways_settle(cluster, tasks_before)
    assert after == tasks_before, (tasks_before, after)
    assert all(streams == 0 for _, streams in after.values())
    assert growth < 25, f"gateway RSS grew {growth:.0f} MiB after warm-up"
