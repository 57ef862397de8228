"""The router counts its own placements and releases between stats polls (issue 18's spurious 429s and
lopsided bursts), a client that is gone stops counting as waiting, and a dead worker's KV gauge goes.

In-process tests use the worker doubles behind an async proxy that answers after a delay, like a Ray
call, with stats polled far apart (30 s): every decision between polls runs on stale stats."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter

import httpx
import pytest

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.worker.worker_config import WorkerConfig
from router.requests.admission import AdmissionController, AdmissionLimits
from router.stats.metrics import RouterMetrics
from router.router import Router
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient
from router_fakes import FakeDecodeWorker, FakePrefillWorker

STALE = dict(stats_interval_s=30.0, reserve_wait_s=0.5)


class Slow:
    """An actor-like proxy: every method answers after `delay_s` (the worker's state changes when the
    call lands, as with Ray), so concurrent placements really overlap."""

    def __init__(self, worker, delay_s: float = 0.02):
        self._w, self._delay = worker, delay_s

    def __getattr__(self, name):
        fn = getattr(self._w, name)

        async def call(*args):
            await asyncio.sleep(self._delay)
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result
        return call


def req(rid, n=5, max_tokens=64):
    return GenerateRequest(rid, tuple(range(5, 5 + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0), 0, 0.0)


@pytest.fixture
def decode_pair(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=256, max_num_seqs=64)
    d0, d1 = FakeDecodeWorker("decode-0", cfg, None, step_delay_s=0.05), FakeDecodeWorker("decode-1", cfg, None, step_delay_s=0.05)
    yield cfg, d0, d1
    d0.shutdown()
    d1.shutdown()


@pytest.mark.parametrize("disaggregated", [False, True])
def test_a_burst_spreads_over_both_decode_workers(decode_pair, disaggregated):
    cfg, d0, d1 = decode_pair
    prefill = []
    if disaggregated:
        p = FakePrefillWorker("prefill-0", cfg, prefill_delay_s=0.0)
        p.init_transport({"decode": {"decode-0": d0, "decode-1": d1}})
        prefill = [WorkerClient("prefill-0", "prefill", Slow(p))]

    async def main():
        router = Router(prefill, [WorkerClient("decode-0", "decode", Slow(d0)), WorkerClient("decode-1", "decode", Slow(d1))],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(prefill_placement="static", **STALE))
        await router.start()
        placed = await asyncio.gather(*(router.submit(req(f"b{i}")) for i in range(16)))
        where = Counter(rs.decode_worker_id for rs in placed)
        for rs in placed:
            router.finish(rs.request_id, abort=True)
        await router.stop()
        return where

    where = asyncio.run(main())
    assert where == {"decode-0": 8, "decode-1": 8}, where


async def _finished(d, rid, timeout=30.0):
    """Requests without a reply_to stay with the double's publisher: wait for the final delta."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(x.request_id == rid and x.finish_reason for b in d.poll_token_batches() for x in b.deltas):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(rid)


def test_an_idle_server_with_stale_stats_never_answers_429(demo_model_dir):
    """One decode worker with room for one big prompt at a time: back-to-back big requests each find
    the blocks of the one before free, although no poll has said so (the router released them)."""
    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=12, max_num_seqs=8)
    d = FakeDecodeWorker("decode-0", cfg, None)

    async def main():
        router = Router([], [WorkerClient("decode-0", "decode", Slow(d))],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(**STALE))
        await router.start()
        polls = 0
        for i in range(6):
            rs = await router.submit(req(f"big{i}", n=150, max_tokens=2))  # 10 of the 11 blocks
            if i == 0:
                await router.poll_once()  # a poll while it runs: the stats now say "1 free block"
                polls = router.health.fresh_as_of
            await _finished(d, rs.request_id)
            router.finish(rs.request_id, generated=2)  # what the gateway's Finish says
        assert router.health.fresh_as_of == polls  # no re-poll was needed: the release was counted
        # Blocks freed behind the router's back (an abort straight on the worker): the polled stats
        # say full, admission re-polls once before answering and then admits.
        d.set_step_delay(0.5)  # it stays while we look
        await router.submit(req("held", n=150, max_tokens=20))
        await router.poll_once()
        d.set_step_delay(0.0)
        d.abort("held")
        router.inflight.pop("held")
        router.admission.release("held")
        rs2 = await router.submit(req("after", n=150, max_tokens=2))
        assert rs2.decode_worker_id == "decode-0" and router.health.fresh_as_of > polls
        router.finish("after", abort=True)
        await router.stop()

    try:
        asyncio.run(main())
    finally:
        d.shutdown()


def test_dead_worker_kv_gauge_is_removed(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=12, max_num_seqs=8)
    d = FakeDecodeWorker("decode-0", cfg, None)

    class Dead:
        def stats(self):
            raise ConnectionError("gone")

    async def main():
        metrics = RouterMetrics("m")
        router = Router([], [WorkerClient("decode-0", "decode", d), WorkerClient("decode-1", "decode", Dead())],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(unhealthy_after_failures=1, **STALE), metrics)
        await router.poll_once()
        text = metrics.render().decode()
        assert 'vllm:kv_cache_usage_perc{engine="decode-0",model_name="m"}' in text
        assert 'worker_id="decode-1"' in text  # its health gauge, at 0
        router.clients["decode-0"].handle = Dead()
        await router.poll_once()
        text = metrics.render().decode()
        assert "vllm:kv_cache_usage_perc{" not in text  # no frozen last value for a dead worker
        assert 'pdserve:worker_healthy{model_name="m",role="decode",worker_id="decode-0"} 0.0' in text

    try:
        asyncio.run(main())
    finally:
        d.shutdown()


# -- over HTTP: a client that goes away while its request waits for a decode worker -----------------
@pytest.fixture(scope="module")
def refusing_cluster(ray_session, demo_model_dir):
    from router_clusters import start_cluster

    sc = start_cluster(demo_model_dir, fakes=True, prefill_workers=0, decode_workers=1, reserve_wait_s=60.0)
    yield sc
    sc.shutdown()


def test_a_gone_client_stops_counting_as_waiting(refusing_cluster):
    import ray

    sc = refusing_cluster
    router = sc.router  # lives on the launcher's loop; its counters are read from here
    decode = sc.workers.decode["decode-0"]
    ray.get(decode.refuse_placements.remote(True))  # admitted, but no decode worker takes them: they wait
    body = {"model": "pdserve-demo", "prompt": "hello there", "max_tokens": 4, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=sc.url, timeout=60) as client:
            async def one():
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    await r.aread()
            tasks = [asyncio.create_task(one()) for _ in range(6)]
            deadline = time.monotonic() + 20
            while router.admission.num_waiting < 6:
                assert time.monotonic() < deadline, router.admission.num_waiting
                await asyncio.sleep(0.02)
            for t in tasks:  # the clients hang up
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        t0 = time.monotonic()
        while router.admission.num_waiting or router.inflight:
            assert time.monotonic() - t0 < 5, (router.admission.num_waiting, list(router.inflight))
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    try:
        released_in = asyncio.run(main())
    finally:
        ray.get(decode.refuse_placements.remote(False))
    print(f"\nwaiting count back to 0 {released_in:.2f}s after the clients left (placement wait: 60s)")
    r = httpx.post(f"{sc.url}/v1/completions", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200


def test_a_reservation_made_as_the_client_leaves_still_reaches_the_prefill_worker(demo_model_dir):
    """Cancelled while D reserved: the reservation lands anyway, so P must be told (it sends D a "no
    KV" for that transfer_seq), or D's in-order receiver would wait on it and stall every later
    transfer from P. Here: P gets the task and its abort, and D's blocks come back."""
    cfg = WorkerConfig(model_dir=str(demo_model_dir), num_blocks=64, max_num_seqs=8)
    d = FakeDecodeWorker("decode-0", cfg, None)
    p = FakePrefillWorker("prefill-0", cfg, prefill_delay_s=0.2)
    p.init_transport({"decode": {"decode-0": d}})

    async def main():
        router = Router([WorkerClient("prefill-0", "prefill", p)], [WorkerClient("decode-0", "decode", Slow(d, 0.5))],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(prefill_placement="static", **STALE))
        await router.start()
        task = asyncio.ensure_future(router.submit(req("left", n=40)))
        await asyncio.sleep(0.2)  # the reserve call is out (D answers after 0.5 s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not router.inflight and router.admission.num_admitted == 0
        deadline = time.monotonic() + 10
        while (d.reserve_calls == 0 or d._reserved or p._jobs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert d.reserve_calls == 1 and p.submitted == 1  # the orphan reservation was handed to P...
        assert not d._reserved and d.stats().free_blocks == d.stats().total_blocks  # ...and D let it go
        await router.stop()

    try:
        asyncio.run(main())
    finally:
        d.shutdown()
