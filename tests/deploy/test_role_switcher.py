"""RoleSwitcher and PlannerLoop on CPU, over a real Router with model-free worker doubles and a fake
cluster (what deploy/serving_cluster.py's ServingCluster offers them: retire_worker, spawn_worker,
worker_client). The real
thing on Ray: test_role_switch.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from cluster.wire.messages import GenerateRequest
from cluster.worker.pass_rate import PassRate
from cluster.sampling.sampling_params import SamplingParams
from deploy.planner_loop import PlannerLoop
from deploy.role_switcher import RoleSwitcher
from router.requests.admission import AdmissionController, AdmissionLimits
from router.placement.pd_planner import PDPlanner, PlannerConfig
from router.router import Router
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
from router_fakes import StubWorker  # noqa: E402


class FakeCluster:
    def __init__(self):
        self.calls = []
        self.spawned: dict[str, StubWorker] = {}

    def retire_worker(self, worker_id: str) -> int:
        self.calls.append(("retire", worker_id))
        return 7  # its placement-group bundle

    def spawn_worker(self, role: str, bundle: int):
        wid = f"{role}-new"
        self.calls.append(("spawn", role, bundle))
        w = self.spawned[wid] = StubWorker(wid, role)
        w.prefill_rate, w.decode_rate = PassRate(0.002, 1e-4, 10), PassRate(0.01, 1e-3, 10)
        return wid, w

    def worker_client(self, worker_id: str, role: str, handle) -> WorkerClient:
        self.calls.append(("client", worker_id, role))
        return WorkerClient(worker_id, role, handle)


def make_router() -> tuple[Router, dict[str, StubWorker]]:
    stubs = {w.worker_id: w for w in (StubWorker("prefill-0", "prefill"), StubWorker("decode-0", "decode"),
                                      StubWorker("decode-1", "decode"))}
    for w in stubs.values():
        w.prefill_rate, w.decode_rate = PassRate(0.002, 1e-4, 10), PassRate(0.01, 1e-3, 10)
    router = Router([WorkerClient("prefill-0", "prefill", stubs["prefill-0"])],
                    [WorkerClient(w, "decode", stubs[w]) for w in ("decode-0", "decode-1")],
                    AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                    RouterConfig(stats_interval_s=0.01, prefill_placement="static", local_prefill_threshold=100))
    return router, stubs


def test_a_switch_drains_the_worker_then_replaces_it_on_its_bundle():
    async def main():
        router, _ = make_router()
        cluster = FakeCluster()
        await router.start()
        rs = await router.submit(GenerateRequest("a", (1, 2, 3), SamplingParams(max_tokens=4), 0, 0.0))
        held = rs.decode_worker_id

        async def finish_later():
            await asyncio.sleep(0.1)
            assert cluster.calls == []  # nothing retired while the request still runs there
            router.finish("a")
        done = asyncio.ensure_future(finish_later())
        new_id = await RoleSwitcher(cluster, router, drain_timeout_s=5.0).switch(held, "prefill")
        await done
        assert cluster.calls == [("retire", held), ("spawn", "prefill", 7), ("client", "prefill-new", "prefill")]
        assert new_id == "prefill-new" and router.prefill_ids == ["prefill-0", "prefill-new"]
        assert held not in router.views and router.view(new_id).healthy  # polled as it joined
        await router.stop()
    asyncio.run(main())


def test_a_switch_that_would_leave_no_decode_worker_is_refused():
    async def main():
        router, _ = make_router()
        await router.start()
        switcher = RoleSwitcher(FakeCluster(), router)
        with pytest.raises(ValueError, match="already"):
            await switcher.switch("decode-0", "decode")
        router.drain_worker("decode-1")
        with pytest.raises(ValueError, match="last decode worker"):
            await switcher.switch("decode-0", "prefill")
        await router.stop()
    asyncio.run(main())


def test_the_planner_loop_reads_the_routers_request_mix_and_switches_a_worker():
    async def main():
        router, _ = make_router()
        cluster = FakeCluster()
        await router.start()
        now = [1000.0]
        loop = PlannerLoop(router, RoleSwitcher(cluster, router, 1.0),
                           PDPlanner(PlannerConfig(min_prefill=1, hysteresis=0.1, min_utilization=0.0, confirmations=1,
                                                   min_dwell_s=0.0)), interval_s=1.0, block_size=16,
                           clock=lambda: now[0])
        for _ in range(300):  # prompt-heavy: the one prefill worker is the bottleneck
            router.arrivals.record_arrival(3000, 4)
            router.arrivals.record_finish(4)
        new_id = await loop.step()
        assert new_id == "prefill-new" and len(router.prefill_ids) == 2 and len(router.decode_ids) == 1
        assert loop.planner.history[-1][1] == (2, 1)
        await router.stop()
    asyncio.run(main())
