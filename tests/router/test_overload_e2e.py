"""429 under overload once the admission queue is full (with Retry-After and an OpenAI error body),
the queued requests served, and service again after."""

from __future__ import annotations

import asyncio

import httpx

from router_clusters import start_cluster
from serving_harness import wait_idle


def test_429_under_overload_then_recovery(ray_session, demo_model_dir):
    import ray

    sc = start_cluster(demo_model_dir, fakes=True, prefill_workers=0, decode_workers=1,
                       max_inflight_tokens=120, max_waiting_requests=3, reserve_wait_s=0.2, retry_after_s=2)
    try:
        decode = next(iter(sc.workers.decode.values()))
        ray.get(decode.set_step_delay.remote(0.02))
        body = {"model": "pdserve-demo", "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True}

        async def burst(n):
            async with httpx.AsyncClient(base_url=sc.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))

        rs = asyncio.run(burst(12))
        ok = [r for r in rs if r.status_code == 200]
        limited = [r for r in rs if r.status_code == 429]
        assert ok and limited and len(ok) + len(limited) == len(rs), [r.status_code for r in rs]
        # 120 in-flight tokens hold at most three (8 + 30)-token requests; three more wait their turn.
        assert len(ok) <= 6 and len(limited) >= 6
        for r in limited:
            assert r.headers["retry-after"] == "2"
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            assert "max_waiting_requests=3" in err["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 30 for r in ok)
        wait_idle(sc)
        # Recovered: the same burst size, sent one at a time, all succeed.
        ray.get(decode.set_step_delay.remote(0.0))
        for _ in range(4):
            assert httpx.post(f"{sc.url}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(f"{sc.url}/metrics").text
        assert 'pdserve:request_rejected_total{model_name="pdserve-demo",status="429"}' in metrics
    finally:
        sc.shutdown()
