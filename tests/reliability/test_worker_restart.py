"""Workers that Ray restarts rejoin, on a real cluster (1 prefill + 2 decode workers, KV over gloo,
`worker_max_restarts` on):

- a decode worker killed mid-load (ray.kill with no_restart=False: Ray restarts its actor): its
  requests migrate and finish exactly; the new incarnation rejoins the KV transport (the prefill
  worker re-forms its pair), the router marks it healthy and places on it again, prefilled remotely
  too; the cluster's KV capacity is back to full;
- the prefill worker killed likewise with prompts queued: they are placed again and finish exactly;
  it comes back and ships KV to both decode workers again;
- both decode workers killed at once: no decode worker is healthy for a while, and the moved requests
  wait for the restarts (migration_wait_s) instead of failing."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from reliability_harness import MODEL, start_cluster, wait_clean, worker_stats
from test_worker_death import _busiest, _prompts, _run_and_kill, hold_prefill


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=2, local_prefill_threshold=10,
                       cpu_num_blocks=128, worker_max_restarts=3)
    yield sc
    sc.shutdown()


def _refs(engine, prompts, n):
    return [r.text for r in engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)]
                                            * len(prompts))]


def _restart(sc, wid):
    """Kills the worker's process; Ray restarts its actor (a new incarnation)."""
    import ray

    ray.kill({**sc.workers.decode, **sc.workers.prefill}[wid], no_restart=False)


def _wait_healthy(sc, wids, timeout_s=90.0) -> float:
    t0 = time.monotonic()
    while not all(sc.router.views[w].healthy for w in wids):
        assert time.monotonic() - t0 < timeout_s, {w: sc.router.views[w].healthy for w in wids}
        time.sleep(0.05)
    return time.monotonic() - t0


def _capacity(sc) -> tuple[int, int]:
    """(free, total) KV blocks over the decode workers that answer."""
    stats = worker_stats(sc).values()
    return sum(s.free_blocks for s in stats), sum(s.total_blocks for s in stats)


def _incarnation(sc, wid) -> str:
    import ray

    return ray.get({**sc.workers.decode, **sc.workers.prefill}[wid].stats.remote()).extra["incarnation"]


async def _exact(sc, prompts, n, refs):
    async with httpx.AsyncClient(base_url=sc.url, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": n,
                                                                    "temperature": 0, "ignore_eos": True})
                                    for p in prompts))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:2]
    assert [r.json()["choices"][0]["text"] for r in rs] == refs


def test_restarted_decode_worker_rejoins(cluster, reference_engine):
    import ray

    router = cluster.router
    full = _capacity(cluster)
    assert full[0] == full[1] > 0
    prompts = _prompts(6, 4) + _prompts(6, 30)  # local prefill and disaggregated
    n = 60
    refs = _refs(reference_engine, prompts, n)
    victim = {}

    def kill():
        victim["id"] = _busiest(cluster, "decode")
        victim["held"] = len(router.views[victim["id"]].inflight)
        victim["inc"] = router.incarnation(victim["id"])
        _restart(cluster, victim["id"])

    out = asyncio.run(_run_and_kill(cluster, prompts, n, kill, when=lambda k: k >= 150))
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:3]
    assert victim["held"] > 0
    assert [t for t, _ in out] == refs
    wid = victim["id"]
    back = _wait_healthy(cluster, [wid])
    assert _incarnation(cluster, wid) != victim["inc"]
    print(f"\n{wid} (held {victim['held']}) restarted and placed on again {back:.1f}s after the streams ended")

    # Placed on again, prefilled locally and remotely (the prefill worker's pair re-formed).
    placed = router.views[wid].placed_total
    before = ray.get(cluster.workers.prefill["prefill-0"].transfer_metrics.remote())["transfers"]
    more = _prompts(8, 4)[2:] + _prompts(8, 30)[2:]
    asyncio.run(_exact(cluster, more, 8, _refs(reference_engine, more, 8)))
    assert router.views[wid].placed_total >= placed + 2
    m = ray.get(cluster.workers.prefill["prefill-0"].transfer_metrics.remote())
    assert m["transfers"] > before
    assert any(r["peer"] == wid and r["ok"] for r in m["recent"]), m["recent"][-6:]
    stats = wait_clean(cluster)
    assert set(cluster.workers.decode) <= set(stats)  # both answer again
    assert _capacity(cluster) == full


def test_restarted_prefill_worker_rejoins(cluster, reference_engine):
    import ray

    router = cluster.router
    full = _capacity(cluster)
    prompts = _prompts(10, 60)  # all above the local threshold: queued on the prefill worker
    n = 10
    refs = _refs(reference_engine, prompts, n)
    held = {}
    hold_prefill(cluster, "prefill-0")  # (the new incarnation's transport has no fault armed)

    def kill():
        held["n"] = len(router.views["prefill-0"].inflight)
        _restart(cluster, "prefill-0")

    out = asyncio.run(_run_and_kill(cluster, prompts, n, kill,
                                    when=lambda k: len(router.views["prefill-0"].inflight) >= 4))
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:2]
    assert [t for t, _ in out] == refs
    assert held["n"] > 0
    back = _wait_healthy(cluster, ["prefill-0"])
    print(f"\nprefill-0 (held {held['n']}) back {back:.1f}s after the streams ended")

    # The new incarnation ships KV to both decode workers (the decode side re-formed the pair on its hello).
    p = cluster.workers.prefill["prefill-0"]
    more = _prompts(14, 40)[10:]
    asyncio.run(_exact(cluster, more, 6, _refs(reference_engine, more, 6)))
    m = ray.get(p.transfer_metrics.remote())
    assert m["transfers"] >= len(more) and m["failures"] == 0
    assert {r["peer"] for r in m["recent"] if r["ok"]} == set(cluster.workers.decode)
    wait_clean(cluster)
    assert _capacity(cluster) == full


def test_migrations_wait_while_every_decode_worker_restarts(cluster, reference_engine):
    router = cluster.router
    full = _capacity(cluster)
    prompts = _prompts(8, 4) + _prompts(4, 30)
    n = 50
    refs = _refs(reference_engine, prompts, n)
    before = router.metrics.migrations._value.get()

    def kill_all():
        for wid in cluster.workers.decode:
            _restart(cluster, wid)

    out = asyncio.run(_run_and_kill(cluster, prompts, n, kill_all, when=lambda k: k >= 100))
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:3]
    assert [t for t, _ in out] == refs
    moved = router.metrics.migrations._value.get() - before
    print(f"\nboth decode workers restarted: {moved:.0f} requests moved, all exact")
    assert moved > 0
    _wait_healthy(cluster, list(cluster.workers.decode))
    wait_clean(cluster)
    assert _capacity(cluster) == full
