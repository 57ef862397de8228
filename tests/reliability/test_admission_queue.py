"""A burst that does not fit right now waits (issue 29 item 2), on a real CPU server with the default KV
pool (1 prefill + 1 decode worker, 512 blocks of 16 tokens: five 1.5k-token prompts at a time):

- 16 concurrent 1.5k-token prompts all succeed (before the admission queue: 7 and 11 of them got 429
  "no decode worker has 94 free KV blocks"); the wait shows in their TTFT and in /metrics
  (`vllm:num_requests_waiting`, `pdserve:request_admission_queue_time_seconds`);
- 429 with Retry-After only when the queue is full (`max_waiting_requests`) or a request's wait
  passes (or would pass) `queue_timeout_s`;
- a request cancelled while it waits leaves nothing: not in the queue, the router, a worker or its
  gateway's token stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import statistics
import time

import httpx
import pytest

from reliability_harness import MODEL, gateway_tasks, start_cluster, wait_clean, wait_gateways_settle

BURST = 16
PROMPT_TOKENS = 1500


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    from deploy.config import ClusterConfig

    # The default pool; prompts go to the prefill worker as Ray calls (the others' clusters send frames).
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=1,
                       cpu_num_blocks=ClusterConfig().cpu_num_blocks, prefill_dispatch="ray")
    yield sc
    sc.shutdown()


@pytest.fixture(scope="module")
def prompts(demo_model_dir):
    from cluster.text.tokenizer import load_tokenizer

    tok = load_tokenizer(demo_model_dir)
    out = []
    for i in range(BURST + 4):
        words = 500
        while True:
            p = f"Burst {i}: " + " ".join(f"w{(i * 7 + k) % 40}" for k in range(words))
            n = len(tok(p).input_ids)
            if n >= PROMPT_TOKENS:
                break
            words += 10
        out.append(p)
    return out


def _limits(sc, **kw):
    """Sets the router's admission limits (on its loop); returns the previous ones."""
    ac = sc.router.admission
    before = ac.limits

    def set_():
        ac.limits = dataclasses.replace(ac.limits, **kw)
    sc.call(set_)
    return before


async def _stream(client, prompt, max_tokens=16):
    """(status, seconds to the first token or None, text, Retry-After, error message)."""
    t0 = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    ttft, text = None, ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            return r.status_code, None, "", r.headers.get("retry-after"), json.loads(raw)["error"]["message"]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                if ev.get("choices") and ev["choices"][0].get("text") is not None:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text += ev["choices"][0]["text"]
    return 200, ttft, text, None, None


def _gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else 0.0


async def _burst(sc, prompts, sample_metrics=False):
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    waiting_seen = []
    async with httpx.AsyncClient(base_url=sc.url, timeout=180, limits=limits) as c:
        done = asyncio.Event()

        async def sample():
            while not done.is_set():
                r = await c.get("/metrics")
                waiting_seen.append(_gauge(r.text, "vllm:num_requests_waiting"))
                await asyncio.sleep(0.1)
        sampler = asyncio.ensure_future(sample()) if sample_metrics else None
        res = await asyncio.gather(*(_stream(c, p) for p in prompts))
        done.set()
        if sampler is not None:
            await sampler
    return res, waiting_seen


def test_a_burst_of_long_prompts_waits_instead_of_failing(cluster, prompts, reference_engine):
    from cluster.sampling.sampling_params import SamplingParams

    res, waiting_seen = asyncio.run(_burst(cluster, prompts[:BURST], sample_metrics=True))
    statuses = [r[0] for r in res]
    ttfts = sorted(r[1] for r in res if r[1] is not None)
    metrics = httpx.get(f"{cluster.url}/metrics").text
    queued = _gauge(metrics, "pdserve:request_admission_queue_time_seconds_count")
    queue_s = _gauge(metrics, "pdserve:request_admission_queue_time_seconds_sum")
    print(f"\n{BURST} x {PROMPT_TOKENS}-token prompts at once: {statuses.count(200)} x 200; TTFT median "
          f"{statistics.median(ttfts):.2f}s, max {ttfts[-1]:.2f}s; num_requests_waiting up to {max(waiting_seen):.0f}; "
          f"admission queue {queue_s:.1f}s over {queued:.0f} requests")
    assert statuses == [200] * BURST, [r for r in res if r[0] != 200][:3]
    assert max(waiting_seen) > 0  # some waited (the pool holds five at a time) ...
    assert queued >= BURST and queue_s > 0  # ... and their wait is in the histogram
    # ... and in their TTFT: every second the server counted in the admission queue is inside some
    # client's time to its first token. (Not the spread of the TTFTs: how the waves of five overlap
    # on two cores put the slowest at 1.88-2.35x the fastest in four runs of cb40ba6 and its
    # successor, and "more than 2x" failed a fresh-venv run at 2de1364: 4.71 s against 2.74 s.)
    assert sum(ttfts) >= queue_s, (sum(ttfts), queue_s)
    refs = reference_engine.generate(prompts[:4], [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 4)
    assert [r[2] for r in res[:4]] == [x.text for x in refs]
    wait_clean(cluster)


def test_a_full_queue_and_a_wait_past_its_timeout_are_429_with_retry_after(cluster, prompts):
    before = _limits(cluster, max_waiting_requests=2)
    try:
        res, _ = asyncio.run(_burst(cluster, prompts[:BURST]))
    finally:
        _limits(cluster, max_waiting_requests=before.max_waiting_requests)
    full = [r for r in res if r[0] == 429]
    ok = [r for r in res if r[0] == 200]
    print(f"\nqueue of 2: {len(ok)} x 200, {len(full)} x 429")
    assert len(ok) + len(full) == BURST and len(ok) >= 5 and full
    assert all(r[3] == str(before.retry_after_s) and "max_waiting_requests=2" in r[4] for r in full), full[:2]
    wait_clean(cluster)

    before = _limits(cluster, queue_timeout_s=0.3)
    try:
        res, _ = asyncio.run(_burst(cluster, prompts[:BURST]))
    finally:
        _limits(cluster, queue_timeout_s=before.queue_timeout_s)
    late = [r for r in res if r[0] == 429]
    print(f"queue timeout 0.3s: {BURST - len(late)} x 200, {len(late)} x 429: {sorted({r[4][:50] for r in late})}")
    assert late and all(r[0] in (200, 429) for r in res)
    assert all(r[3] == str(before.retry_after_s) and "queue_timeout_s=0.3" in r[4] for r in late), late[:2]
    wait_clean(cluster)


def test_a_request_cancelled_while_queued_leaves_nothing(cluster, prompts):
    router = cluster.router
    tasks_before = gateway_tasks(cluster)

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180,
                                     limits=httpx.Limits(max_connections=32)) as c:
            # Five long-running requests fill the pool (5 x ceil((1.5k + 90) / 16) = 500 of its 511 blocks:
            # they fit to their last token, so none is preempted, and nothing else fits); three more wait
            # in the queue. (With 160 tokens each they outgrew the pool: a preemption freed room at a
            # moment only timing decided, and a queued request got in.)
            running = [asyncio.ensure_future(_stream(c, p, max_tokens=90)) for p in prompts[:5]]
            deadline = time.monotonic() + 60
            while router.admission.num_admitted < 5:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            # NOTE: sent once the decode worker's own stats count the five (no placement of theirs left
            # in the router's correction): sent right after the fifth was admitted, the three were
            # sometimes admitted too and then refused by the worker (429 after reserve_wait_s). Not
            # found yet: RELIABILITY.md, "Open".
            while not all(not v.placing and v.stats.running + v.stats.waiting >= 5 for v in router.decode_views()):
                assert time.monotonic() < deadline, [(v.placing, v.stats) for v in router.decode_views()]
                await asyncio.sleep(0.02)
            queued = [asyncio.ensure_future(_stream(c, p)) for p in prompts[5:8]]
            while router.admission.num_queued < 3:
                assert time.monotonic() < deadline, (router.admission.num_queued, router.admission.num_admitted,
                                                     [q.result() for q in queued if q.done()])
                await asyncio.sleep(0.02)
            queued[1].cancel()  # its client goes away while it waits
            await asyncio.gather(queued[1], return_exceptions=True)
            t0 = time.monotonic()
            while router.admission.num_queued != 2:
                assert time.monotonic() - t0 < 5, router.admission.num_queued
                await asyncio.sleep(0.02)
            assert router.admission.num_admitted == 5 and len(router.inflight) == 5
            rest = await asyncio.gather(*running, queued[0], queued[2])
            return rest
    # The queued ones must wait, not be refused for the wait they would have: this test is about a
    # cancellation, and the measured admission rate of earlier tests' bursts says nothing here.
    before = _limits(cluster, queue_timeout_s=600.0)
    try:
        rest = asyncio.run(main())
    finally:
        _limits(cluster, queue_timeout_s=before.queue_timeout_s)
    assert [r[0] for r in rest] == [200] * 7
    wait_clean(cluster)
    assert wait_gateways_settle(cluster, tasks_before) == tasks_before


def test_with_ray_dispatch_no_prompt_came_as_a_frame(cluster):
    """prefill_dispatch "ray": the prefill worker computed this module's prompts, every one of them from a
    Ray call (its dispatch socket is there, and took nothing)."""
    import ray

    stats = ray.get(next(iter(cluster.workers.prefill.values())).stats.remote())
    assert stats.prefill_tokens_total >= BURST * PROMPT_TOKENS // 2 and stats.extra["dispatch"]
    assert stats.extra["dispatch_received"] == 0
