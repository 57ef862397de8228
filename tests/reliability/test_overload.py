"""Overload: a burst of 10 x capacity gets 429 + Retry-After at once for what neither runs nor fits in
the admission queue while the admitted and the queued requests finish; gateway memory stays bounded
over repeated bursts; a KV pool too small for the running batch preempts (recompute) and still
produces exactly the reference engine's greedy text. (Bursts that fit the queue: test_admission_queue.py.)"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from reliability_harness import MODEL, is_openai_error, rss_mb, start_cluster, wait_clean, worker_stats

CAPACITY = 8  # max_num_seqs == max_waiting_requests: 8 run, 8 wait in the admission queue
KV_BLOCKS = 32  # x 16 tokens: far less than the preemption test's batch needs


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, max_num_seqs=CAPACITY, max_waiting_requests=CAPACITY, cpu_num_blocks=KV_BLOCKS,
                       reserve_wait_s=0.2, retry_after_s=3)
    yield sc
    sc.shutdown()


async def _timed_post(client, body):
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=body)
    return r, time.monotonic() - t0


async def _burst(url, n, body):
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        return await asyncio.gather(*(_timed_post(c, body) for _ in range(n)))


def test_burst_of_10x_capacity(cluster):
    # Long enough that no admitted request can finish while the burst is still being answered.
    body = {"model": MODEL, "prompt": "Once upon a time there was", "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}
    res = asyncio.run(_burst(cluster.url, 10 * CAPACITY, body))
    ok = [(r, t) for r, t in res if r.status_code == 200]
    limited = [(r, t) for r, t in res if r.status_code == 429]
    assert len(ok) + len(limited) == len(res), sorted({r.status_code for r, _ in res})
    assert CAPACITY < len(ok) < len(res) and limited  # some that did not fit at once waited their turn
    for r, _ in limited:
        assert r.headers["retry-after"] == "3" and is_openai_error(r)
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r, _ in ok)
    assert len({r.json()["choices"][0]["text"] for r, _ in ok}) == 1  # same greedy prompt: same text
    lat_429 = sorted(t for _, t in limited)
    lat_ok = sorted(t for _, t in ok)
    p99 = lat_429[int(0.99 * (len(lat_429) - 1))]
    print(f"\nburst {len(res)}: {len(ok)} admitted (first done {lat_ok[0]:.2f}s, median {statistics.median(lat_ok):.2f}s), "
          f"{len(limited)} x 429 (median {statistics.median(lat_429) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms)")
    # "At once": a 429 never waits for a request to finish (capacity frees only then), so the 429s are
    # answered before the first admitted request is. Against that request, not a number of seconds:
    # both are CPU-bound here and scale with the machine (stop 44's CI: p99 2.06 s, first done 2.15 s).
    assert p99 < lat_ok[0], (p99, lat_ok[0])
    wait_clean(cluster)


def test_memory_bounded_over_bursts(cluster):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    asyncio.run(_burst(cluster.url, 10 * CAPACITY, body))  # warm-up
    before = rss_mb(cluster)
    for _ in range(4):
        asyncio.run(_burst(cluster.url, 10 * CAPACITY, body))
    after = rss_mb(cluster)
    print(f"\ngateway RSS over 4 bursts of {10 * CAPACITY}: {before:.0f} -> {after:.0f} MiB")
    assert after - before < 40
    wait_clean(cluster)


def test_kv_exhaustion_preempts_and_stays_exact(cluster, reference_engine):
    before = sum(s.extra["preemptions"] for s in worker_stats(cluster).values())
    prompts = [f"Tale {i}: the dragon of the mountain said" + " once more" * (i % 3) for i in range(CAPACITY)]
    n = 90  # 8 x (~20 + 90) tokens need ~60 blocks; the pool has 32
    refs = reference_engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)] * len(prompts))

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as c:
            async def one(p):
                for _ in range(100):  # 429 while the pool is full: retry as a client would
                    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": n,
                                                               "temperature": 0, "ignore_eos": True})
                    if r.status_code != 429:
                        return r
                    await asyncio.sleep(0.05)
                return r
            return await asyncio.gather(*(one(p) for p in prompts))

    rs = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs), [r.text[:200] for r in rs if r.status_code != 200]
    assert [r.json()["choices"][0]["text"] for r in rs] == [x.text for x in refs]
    after = sum(s.extra["preemptions"] for s in worker_stats(cluster).values())
    print(f"\npreemptions: {after - before}")
    assert after > before  # the pool really ran out mid-decode
    wait_clean(cluster)
