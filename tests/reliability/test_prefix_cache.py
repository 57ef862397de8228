"""Prefix caching under churn, on a real cluster (1 prefill + 2 decode workers, KV over gloo, the
prefix_aware decode policy, KV pools small enough that cached blocks must be evicted): sessions that
share a system prompt and resend their conversation, with clients going away at random points. Every
request that completes is exactly the reference engine's greedy text; afterwards every block is back
in its pool and the block accounting holds on every worker (no leaked or doubly owned block, no
cached block reused while a reservation pinned it); the caches were hit and did evict."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from reliability_harness import MODEL, start_cluster, stream_completion, wait_clean, worker_stats

SESSIONS = 6
TURNS = 4


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=2, local_prefill_threshold=10,
                       cpu_num_blocks=48, decode_policy="prefix_aware", prefill_policy="prefix_aware",
                       max_num_seqs=8)
    yield sc
    sc.shutdown()


def test_shared_prefixes_with_disconnects_stay_exact_and_leak_nothing(cluster, reference_engine):
    rng = random.Random(17)
    system = "You are a terse assistant. " + " ".join(f"rule{k} w{k % 13}" for k in range(40))
    history = [system for _ in range(SESSIONS)]
    outcomes = {"complete": 0, "cut": 0, "cancelled": 0}
    checked = 0

    async def one(client, s, turn):
        nonlocal checked
        prompt = history[s] + f" User {s}.{turn}: " + " ".join(f"q{rng.randrange(30)}" for _ in range(rng.randrange(2, 9)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        how = rng.choice(["complete", "complete", "cut", "cancel"])
        if how == "complete":
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            ref = reference_engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))[0].text
            assert text == ref, (s, turn)
            checked += 1
            history[s] = prompt + text  # the next turn resends the conversation
        elif how == "cut":
            await stream_completion(client, body, stop_after=rng.randint(1, 6))
            history[s] = prompt
        else:
            try:
                await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=rng.uniform(0.0, 0.4))
            except asyncio.TimeoutError:
                pass
            how = "cancelled"
        outcomes[how] += 1

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            for turn in range(TURNS):
                await asyncio.gather(*(one(client, s, turn) for s in range(SESSIONS)))

    asyncio.run(main())
    print(f"\nprefix cache under churn: {outcomes}, {checked} completions checked exact")
    stats = wait_clean(cluster)  # also checks every worker's block accounting
    assert all(s.free_blocks == s.total_blocks for s in stats.values())
    ex = [s.extra for s in stats.values()]
    print({w: {k: v for k, v in s.extra.items() if k.startswith("prefix_cache")} for w, s in stats.items()})
    assert sum(e["prefix_cache_hits"] for e in ex) > 0
    assert sum(e["prefix_cache_evicted_blocks"] for e in ex) > 0
    assert checked > 0
    r = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": system, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert worker_stats(cluster, ("decode", "prefill"))
