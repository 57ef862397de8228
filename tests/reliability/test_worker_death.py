"""Worker death under load, on a real cluster (1 prefill + 3 decode workers, KV over gloo):

- a decode worker killed (ray.kill) mid-stream: its requests migrate (prompt + tokens so far,
  re-prefilled on a healthy worker) and every stream still equals the reference engine's greedy text
  token for token: no gap, no duplicate, no error event;
- with migration off, the dead worker's requests end with a clear error event, the others finish;
- the prefill worker killed with prompts on it (its transfer stuck, so the kill finds them there):
  they are placed again (prefilled on a decode worker) and finish exactly;
- after each, new requests are served and no KV block is left held on any live worker."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from reliability_harness import MODEL, start_cluster, stream_completion, wait_clean


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=3, local_prefill_threshold=10,
                       cpu_num_blocks=256)
    yield sc
    sc.shutdown()


def _prompts(n: int, words: int) -> list[str]:
    return [f"Story {i}: " + " ".join(f"w{(i * 13 + k) % 40}" for k in range(words)) for i in range(n)]


async def _run_and_kill(sc, prompts, max_tokens, kill, when):
    """Streams every prompt at once; calls `kill()` once `when(events so far)` holds."""
    events = {"n": 0}
    killed = asyncio.Event()

    async def watch():
        while not when(events["n"]):
            await asyncio.sleep(0.005)
        kill()
        killed.set()

    async def one(client, p):
        body = {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        text, evs = "", []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json
                    ev = json.loads(line[6:])
                    evs.append(ev)
                    events["n"] += 1
                    if ev.get("choices"):
                        text += ev["choices"][0]["text"]
        return text, evs

    async with httpx.AsyncClient(base_url=sc.url, timeout=120, limits=httpx.Limits(max_connections=64)) as c:
        watcher = asyncio.ensure_future(watch())
        out = await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), timeout=120)
        assert killed.is_set()
        watcher.cancel()
    return out


def _busiest(sc, role):
    router = sc.router
    ids = router.decode_ids if role == "decode" else router.prefill_ids
    live = [w for w in ids if router.views[w].healthy]
    return max(live, key=lambda w: len(router.views[w].inflight))


def _kill(sc, wid):
    import ray

    handle = {**sc.workers.decode, **sc.workers.prefill}[wid]
    ray.kill(handle, no_restart=True)
    print(f"\nkilled {wid} holding {len(sc.router.views[wid].inflight)} requests")


def hold_prefill(sc, wid) -> None:
    """Arms a stuck transfer on the prefill worker: its next bundle never moves, so what is placed on
    it stays there (mid-transfer or queued behind) until it dies. Without it a fast machine prefills
    and ships every prompt between two looks at the router, and the kill finds nothing to move."""
    import ray

    ray.get(sc.workers.prefill[wid].inject_transport_fault.remote("stuck_transfer"))


def _serves(sc) -> None:
    r = httpx.post(f"{sc.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Story 99: w1 w2 w3 " * 5, "max_tokens": 6})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


def test_decode_worker_death_migrates_streams_exactly(cluster, reference_engine):
    prompts = _prompts(8, 4) + _prompts(8, 30)  # local prefill and disaggregated
    n = 80
    refs = [r.text for r in reference_engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0,
                                                                               ignore_eos=True)] * len(prompts))]
    victim = {}

    def kill():
        victim["id"] = _busiest(cluster, "decode")
        victim["held"] = len(cluster.router.views[victim["id"]].inflight)
        _kill(cluster, victim["id"])

    t0 = time.monotonic()
    out = asyncio.run(_run_and_kill(cluster, prompts, n, kill, when=lambda k: k >= 200))
    texts = [t for t, _ in out]
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:3]
    assert victim["held"] > 0
    assert texts == refs  # greedy output continues exactly: no gap, no duplicate
    assert all(evs[-1]["usage"]["completion_tokens"] == n for _, evs in out)
    migrated = cluster.router.metrics.migrations._value.get()
    print(f"decode death: {len(prompts)} streams in {time.monotonic() - t0:.1f}s, {migrated:.0f} migrated, all exact")
    assert migrated >= victim["held"]
    assert not cluster.router.views[victim["id"]].healthy
    _serves(cluster)
    wait_clean(cluster)


def test_decode_worker_death_without_migration_ends_with_error_event(cluster, reference_engine):
    router = cluster.router
    router.cfg = dataclasses.replace(router.cfg, migrate_on_worker_death=False)
    try:
        prompts = _prompts(10, 4)
        n = 60
        refs = [r.text for r in reference_engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0,
                                                                                   ignore_eos=True)] * len(prompts))]
        victim = {}

        def kill():
            victim["id"] = _busiest(cluster, "decode")
            victim["held"] = set(router.views[victim["id"]].inflight)
            _kill(cluster, victim["id"])
        out = asyncio.run(_run_and_kill(cluster, prompts, n, kill, when=lambda k: k >= 60))
    finally:
        router.cfg = dataclasses.replace(router.cfg, migrate_on_worker_death=True)
    failed = [(t, evs) for t, evs in out if "error" in evs[-1]]
    assert len(failed) == len(victim["held"]) > 0
    for _, evs in failed:
        assert f"decode worker {victim['id']} died" in evs[-1]["error"]["message"]
    for (text, evs), ref in zip(out, refs):
        if "error" not in evs[-1]:
            assert text == ref  # everyone else completes, exactly
    print(f"migration off: {len(failed)} error events, {len(out) - len(failed)} completed")
    _serves(cluster)
    wait_clean(cluster)


def test_prefill_worker_death_retries_elsewhere(cluster, reference_engine):
    prompts = _prompts(12, 60)  # all above the local threshold: queued on the prefill worker
    n = 12
    refs = [r.text for r in reference_engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0,
                                                                               ignore_eos=True)] * len(prompts))]
    router = cluster.router
    held = {}
    hold_prefill(cluster, "prefill-0")

    def kill():
        held["n"] = len(router.views["prefill-0"].inflight)
        _kill(cluster, "prefill-0")

    out = asyncio.run(_run_and_kill(cluster, prompts, n, kill,
                                    when=lambda k: len(router.views["prefill-0"].inflight) >= 4))
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:2]
    assert [t for t, _ in out] == refs
    print(f"prefill death: {held['n']} queued requests retried, all exact")
    assert held["n"] > 0
    _serves(cluster)
    wait_clean(cluster, timeout_s=60)
