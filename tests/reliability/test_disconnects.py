"""Clients that go away at random points under load (before the first byte, mid-stream, while a
non-streaming answer is computed, while the prompt is being prefilled or its KV transferred): every KV
block returns to the free pool on every worker, prefill and decode, and the router holds nothing."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from reliability_harness import MODEL, api_server_pids, gateway_tasks, start_cluster, stream_completion, wait_clean, wait_gateways_settle

REQUESTS = 48
CONCURRENCY = 12


@pytest.fixture(scope="module", params=[1, 2], ids=["api1", "api2"])
def cluster(ray_session, demo_model_dir, request):
    # One prefill worker (KV over the real gloo transport) and two decode workers; short prompts are
    # prefilled on the decode worker, so both paths see disconnects; one API server, then two.
    from deploy.kv_transport_group import form_kv_transport_group

    before = {}

    def form(prefill, decode, cfg, **where):
        before["listeners"] = _worker_listeners()  # Ray's own: no KV channel exists yet
        return form_kv_transport_group(prefill, decode, cfg, **where)
    sc = start_cluster(demo_model_dir, form_transport_group=form, prefill_workers=1, decode_workers=2,
                       local_prefill_threshold=10, cpu_num_blocks=128, api_servers=request.param)
    sc.listeners_before_traffic = before["listeners"]
    yield sc
    sc.shutdown()


async def _one(client, rng: random.Random, i: int, outcomes: dict):
    words = rng.choice([3, 8, 40, 120])
    body = {"model": MODEL, "prompt": " ".join(f"w{(i * 7 + k) % 50}" for k in range(words)),
            "max_tokens": rng.choice([16, 64, 200]), "ignore_eos": True, "temperature": rng.choice([0, 0.8])}
    how = rng.choice(["stream_cut", "stream_cut", "stream_cut", "cancel", "cancel", "complete"])
    try:
        if how == "stream_cut":  # reads k events, then closes the connection
            await stream_completion(client, body, stop_after=rng.randint(1, 12))
        elif how == "cancel":  # the client gives up after a random delay (any phase, even prefill)
            coro = (client.post("/v1/completions", json=body) if rng.random() < 0.5
                    else stream_completion(client, body))
            await asyncio.wait_for(coro, timeout=rng.uniform(0.0, 0.6))
        else:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code in (200, 429), r.text
        outcomes[how] = outcomes.get(how, 0) + 1
    except asyncio.TimeoutError:
        outcomes["cancelled"] = outcomes.get("cancelled", 0) + 1


def test_random_disconnects_leak_nothing(cluster):
    rng = random.Random(8)
    tasks_before = gateway_tasks(cluster)
    outcomes: dict = {}

    async def main():
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60,
                                     limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:
            async def bounded(i):
                async with sem:
                    await _one(client, rng, i, outcomes)
            await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(REQUESTS))), timeout=90)

    t0 = time.monotonic()
    asyncio.run(main())
    print(f"\ndisconnects: {REQUESTS} requests in {time.monotonic() - t0:.1f}s, outcomes {sorted(outcomes.items())}")
    stats = wait_clean(cluster)
    print("blocks free/total after:", {w: f"{s.free_blocks}/{s.total_blocks}" for w, s in stats.items()})
    assert len(stats) == 3 and all(s.free_blocks == s.total_blocks for s in stats.values())
    # No per-request asyncio task or token stream outlives its request on any gateway's loop.
    assert wait_gateways_settle(cluster, tasks_before) == tasks_before
    # And the cluster still serves.
    r = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


def _worker_listeners() -> set[tuple[int, str, int]]:
    import psutil

    out = set()
    for p in psutil.process_iter(["cmdline"]):
        if any(("PrefillWorkerActor" in a or "DecodeWorkerActor" in a) for a in (p.info["cmdline"] or [])):
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((p.pid, c.laddr.ip, c.laddr.port))
    return out


def test_internal_sockets_listen_on_loopback_only(cluster):
    """In the local cluster the KV rendezvous store (its own process, the launcher's grandchild), the
    router's step-record sink and prefill answer socket (launcher), the token streams and the HTTP port (API servers), the
    decode workers' KV control inboxes and the gloo pairs (both formed before /ready) listen on
    127.0.0.1, never a wildcard. (Each worker process also has Ray's own core-worker server, there
    before the KV transport group formed: Ray's.)"""
    import psutil

    mine = {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}
    store = cluster._kv_store
    # its own process, forked from the launcher's process template (cluster/process/)
    assert psutil.Process(store.pid).parent().ppid() == os.getpid() and store.port not in mine
    assert {c.laddr.port: c.laddr.ip for c in psutil.Process(store.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN} == {store.port: "127.0.0.1"}
    assert mine[int(cluster.router_server.stats_sink.rsplit(":", 1)[1])] == "127.0.0.1"
    assert mine[int(cluster.prefill_answers.endpoint.rsplit(":", 1)[1])] == "127.0.0.1"
    sinks = {g.sink for g in cluster.router_server.gateways.values()}
    gateways = {(c.laddr.ip, c.laddr.port) for pid in api_server_pids(cluster)
                for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert {port for _, port in gateways} >= {int(s.rsplit(":", 1)[1]) for s in sinks} and len(sinks) >= 1
    assert {ip for ip, _ in gateways} == {"127.0.0.1"}
    actors = {pid for pid, _, _ in cluster.listeners_before_traffic}
    ours = {x for x in _worker_listeners() - cluster.listeners_before_traffic if x[0] in actors}
    print(f"\nworker listeners opened by the KV transport: {sorted(ours)}")
    assert len(ours) >= 4  # each decode worker's inbox, and both ends of each gloo pair
    assert {ip for _, ip, _ in ours} == {"127.0.0.1"}
