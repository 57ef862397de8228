"""Where a tensor-parallel worker's ranks run, on a real Ray cluster with fake GPU resources (the real
RayWorkers placement and RayRankLauncher, worker doubles that only report where they are): each worker's
rank 0 and its followers share one node and one placement-group bundle, each rank holds one GPU of its
own and no GPU is shared between workers; prefill and decode workers of different sizes get bundles of
their sizes; a follower dies with its rank 0 (Ray's ownership), and the restarted rank 0 gets new
followers in the same bundle (the same GPUs)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from deploy.config import ClusterConfig
from deploy.ray_runtime import workers_at_launcher_priority

pytestmark = pytest.mark.own_ray  # a Ray with 6 fake GPUs, not the run's one Ray


class _FakeFollower:
    def __init__(self, worker_id, cfg, rank, rendezvous):
        self.rank = rank

    def where(self) -> dict:
        from cluster.distributed.placement import where_am_i

        return {**where_am_i(), "rank": self.rank}


class _FakeRank0:
    def __init__(self, worker_id, cfg, stats_sink=None, rank_launcher=None):
        from cluster.distributed.tp_group import TPRendezvous

        self.cfg = cfg
        self.followers = [] if rank_launcher is None else rank_launcher.launch(
            TPRendezvous("127.0.0.1", 1, "unused", cfg.tensor_parallel_size))

    def stats(self) -> dict:
        return {}

    def ranks(self) -> list[dict]:
        import ray

        from cluster.distributed.placement import where_am_i

        return [{**where_am_i(), "rank": 0}] + ray.get([f.where.remote() for f in self.followers])

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def ray_with_gpus():
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) < 6:
            pytest.skip("a Ray session without 6 (fake) GPUs is already running in this process")
        yield ray
        return
    workers_at_launcher_priority()
    ray.init(num_cpus=8, num_gpus=6, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.shutdown()


def test_ranks_share_a_node_and_a_bundle_with_a_gpu_each(ray_with_gpus, demo_model_dir):
    import psutil
    import ray

    from deploy.ray_workers import RayWorkers

    # 1 prefill worker of 2 ranks, 2 decode workers of 2 ranks: 6 GPUs, one each.
    cfg = ClusterConfig(model=str(demo_model_dir), prefill_workers=1, decode_workers=2, prefill_tp=2, decode_tp=2,
                        gpus_per_worker=1.0, device="cpu", cpus_per_worker=0.5, worker_max_restarts=1)
    workers = RayWorkers(cfg, "pdserve-tp-placement", prefill_actor_cls=_FakeRank0, decode_actor_cls=_FakeRank0,
                         follower_cls={"prefill": _FakeFollower, "decode": _FakeFollower})
    try:
        workers.place(str(demo_model_dir), "ipc://unused")
        seen_gpus = {}
        for wid, h in workers.handles.items():
            ranks = ray.get(h.ranks.remote(), timeout=60)
            assert [r["rank"] for r in ranks] == [0, 1], wid
            assert len({r["node_id"] for r in ranks}) == 1, ranks  # one node
            assert {r["placement_group"] for r in ranks} == {workers.placement_group.id.hex()}
            gpus = [g for r in ranks for g in r["gpu_ids"]]
            assert len(gpus) == 2 and len(set(gpus)) == 2, ranks  # a GPU each, not shared
            assert all(len(r["gpu_ids"]) == 1 and r["cuda_visible_devices"] == r["gpu_ids"][0] for r in ranks)
            seen_gpus[wid] = set(gpus)
        every = [g for s in seen_gpus.values() for g in s]
        assert len(every) == len(set(every)) == 6  # no GPU in two workers
        table = ray.util.placement_group_table(workers.placement_group)
        assert [b.get("GPU") for b in table["bundles"].values()] == [2.0, 2.0, 2.0]  # a bundle per worker

        # Rank 0 dies: its follower goes with it; Ray restarts rank 0, which starts a new follower in
        # the same bundle (the same two GPUs).
        h = workers.decode["decode-0"]
        old = ray.get(h.ranks.remote())
        os.kill(old[0]["pid"], 9)
        deadline = time.monotonic() + 60
        while True:
            try:
                new = ray.get(h.ranks.remote(), timeout=10)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "rank 0 was not restarted"
                time.sleep(0.2)
        assert new[0]["pid"] != old[0]["pid"] and new[1]["pid"] != old[1]["pid"]
        assert not psutil.pid_exists(old[1]["pid"]) or psutil.Process(old[1]["pid"]).status() == psutil.STATUS_ZOMBIE
        assert {g for r in new for g in r["gpu_ids"]} == seen_gpus["decode-0"]
    finally:
        workers.stop()
