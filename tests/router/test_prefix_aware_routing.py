"""The router with the prefix_aware decode policy over two real DecodeWorkers in process (no Ray):
the workers' block events reach the router's index, and a follow-up that resends a conversation goes
to the worker that caches it (least_loaded alternates between idle workers instead)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.worker.worker_config import WorkerConfig
from decode_worker.decode_worker import DecodeWorker
from router.requests.admission import AdmissionController, AdmissionLimits
from router.router import Router
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient


@pytest.fixture(scope="module")
def decode_workers(demo_model_dir):
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", num_blocks=64, max_num_seqs=4)
    ws = [DecodeWorker(f"decode-{i}", cfg) for i in range(2)]
    yield ws
    for w in ws:
        w.shutdown()


def wait_finished(worker: DecodeWorker, rid: str, timeout=60.0) -> list[int]:
    tokens, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for b in worker.poll_token_batches(0.05):
            for d in b.deltas:
                if d.request_id == rid:
                    tokens += d.token_ids
                    if d.finish_reason:
                        return tokens
    raise TimeoutError(rid)


def test_a_follow_up_goes_where_its_conversation_is_cached(decode_workers):
    rng = random.Random(5)
    prompt = [0] + [rng.randrange(5, 500) for _ in range(120)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    by_id = {w.worker_id: w for w in decode_workers}

    async def main():
        router = Router([], [WorkerClient(w.worker_id, "decode", w) for w in decode_workers],
                        AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                        RouterConfig(stats_interval_s=0.01, decode_policy="prefix_aware"))
        await router.start()
        try:
            placed = []
            for turn in range(3):
                rid = f"turn{turn}"
                rs = await router.submit(GenerateRequest(rid, tuple(prompt), params, 0, 0.0))
                placed.append(rs.decode_worker_id)
                answer = await asyncio.to_thread(wait_finished, by_id[rs.decode_worker_id], rid)
                router.finish(rid)
                await router.poll_once()  # the worker's block events reach the index
                prompt.extend(answer + [rng.randrange(5, 500) for _ in range(10)])
            assert placed == [placed[0]] * 3
            home = placed[0]
            assert router.kv_index.num_blocks(home) >= (len(prompt) - 30) // 16
            # An unrelated prompt is not drawn there: idle workers alternate as under least_loaded.
            rs = await router.submit(GenerateRequest("other", tuple(range(300, 420)), params, 0, 0.0))
            assert rs.decode_worker_id != home
            await asyncio.to_thread(wait_finished, by_id[rs.decode_worker_id], "other")
            router.finish("other")
        finally:
            await router.stop()

    asyncio.run(main())
    ex = by_id[decode_workers[0].worker_id].stats().extra, by_id[decode_workers[1].worker_id].stats().extra
    assert sum(e["prefix_cache_hits"] for e in ex) >= 2 * 7 * 16  # turns 2 and 3 found turn 1's blocks
