"""The P:D planner switching a worker's role on a real cluster (real Ray actors, real KV transport over
gloo, real router and gateway over HTTP, CPU): the planner, fed a prompt-heavy request mix, moves a
decode worker to prefill on the same placement-group bundle while requests are in flight; every greedy
output equals the reference engine's, before, during and after; the new prefill worker ships KV to the
remaining decode worker. Also: every worker warmed up before the server accepted its first request, and
froze its startup heap."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from serving_harness import MODEL, completion_text, start_cluster, wait_clean


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    # A quarter CPU each: other test modules' session-long clusters may hold Ray's CPUs meanwhile.
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=2, prefill_placement="static",
                       cpu_num_blocks=128, cpus_per_worker=0.25, warmup=True)
    yield sc
    sc.shutdown()


def _prompt(i: int, n: int) -> list[int]:
    return [0] + [5 + (i * 37 + k * 11) % 480 for k in range(n - 1)]


async def _complete(client, prompt, max_tokens, stream):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return await completion_text(client, body)


def test_workers_warmed_up_before_serving(cluster):
    import ray

    handles = {**cluster.workers.prefill, **cluster.workers.decode}
    for wid, h in handles.items():
        warm = ray.get(h.stats.remote()).extra["warmup"]
        assert warm["prefill_passes"] > 0, wid
        assert warm["finished_at"] < cluster.serving_since, wid
        # Then its process's startup heap was frozen (cluster/worker/startup_heap.py); the switch below
        # serves, retires and spawns with the workers' heaps frozen.
        assert warm["heap"]["frozen_objects"] > 10_000, (wid, warm["heap"])
        if wid.startswith("decode"):
            assert warm["requests"] == 5  # the local-prefill path once per sampler variant, one under a grammar (+ one decoding)
    # The warm-up seeded the measured rates the router plans with.
    views = cluster.router.views
    assert all(v.stats.prefill_rate is not None for v in views.values())
    assert all(views[w].stats.decode_rate is not None for w in cluster.workers.decode)


def test_planner_switches_a_decode_worker_to_prefill_and_serving_stays_exact(cluster, reference_engine):
    from deploy.planner_loop import PlannerLoop
    from router.placement.pd_planner import PDPlanner, PlannerConfig

    sc = cluster
    router = sc.router  # on the launcher's loop (sc._loop)
    loop = PlannerLoop.for_cluster(sc, router)
    loop.planner = PDPlanner(PlannerConfig(min_prefill=1, hysteresis=0.1, min_utilization=0.0, confirmations=1,
                                           min_dwell_s=0.0))
    prompts = [_prompt(i, 20 + 7 * i) for i in range(8)]
    lens = [24, 30, 8, 12, 6, 10, 9, 14]
    refs = [r.text for r in reference_engine.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens])]

    async def main():
        async with httpx.AsyncClient(base_url=sc.url, timeout=300) as client:
            # Two requests decode while the planner acts (each decode worker holds one).
            inflight = [asyncio.create_task(_complete(client, prompts[i], lens[i], stream=i == 0)) for i in (0, 1)]
            while sum(len(router.views[w].inflight) > 0 for w in list(router.decode_ids)) < 2:
                await asyncio.sleep(0.02)
            # A prompt-heavy mix (long prompts, a few output tokens): prefill is the bottleneck.
            for _ in range(300):
                router.arrivals.record_arrival(3000, 4)
                router.arrivals.record_finish(4)
            # The planner runs where it does in `pdserve serve`: on the router's event loop.
            new_id = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(loop.step(), sc._loop))
            during = await asyncio.gather(*inflight)
            after = await asyncio.gather(*(_complete(client, prompts[i], lens[i], stream=i % 2 == 0)
                                           for i in range(2, 8)))
            return new_id, during + after

    before = set(router.views)
    new_id, texts = asyncio.run(main())
    assert texts == refs
    assert new_id is not None and new_id.startswith("prefill-") and new_id not in before
    assert len(router.prefill_ids) == 2 and len(router.decode_ids) == 1
    assert set(sc.workers.prefill) == set(router.prefill_ids) and set(sc.workers.decode) == set(router.decode_ids)
    assert loop.planner.history and loop.planner.history[-1][1] == (2, 1)
    # The new prefill worker computed prompts and shipped their KV to the remaining decode worker.
    assert router.views[new_id].placed_total > 0
    stats = wait_clean(sc)
    assert set(stats) == {*router.prefill_ids, *router.decode_ids}
    assert stats[new_id].prefill_tokens_total > 0
    # Nothing is left of the retired worker: its bundle serves the new one.
    assert len(set(sc.workers.bundle.values())) == 3
    metrics = httpx.get(f"{sc.url}/metrics").text
    assert f'worker_id="{next(iter(before - set(router.views)))}"' not in metrics
