"""Fixtures of the router/gateway tests: one Ray session, clusters built by the real launcher.

End-to-end clusters run real Ray actors, the real router and gateway under uvicorn on 127.0.0.1, and
are reached over real HTTP. `fake_cluster` uses the worker doubles of router_fakes.py (1 prefill +
2 decode, disaggregated path); `real_decode_cluster` uses the real DecodeWorkerActor with every
prompt prefilled on it (prefill_workers=0), which needs no KV transport.
"""

from __future__ import annotations

import logging
import time

import pytest

import router_fakes


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    # The doubles live in a test directory Ray's workers can't import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(router_fakes)
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield ray
    ray.shutdown()


def start_cluster(demo_model_dir, fakes: bool, real_prefill: bool = False, **overrides):
    from cluster.config import ClusterConfig
    from cluster.launch import ServingCluster

    settings = dict(model=str(demo_model_dir), served_model_name="pdserve-demo", port=0, cpu_num_blocks=256, max_num_seqs=32, use_cuda_graph=False,
                    stats_interval_s=0.05, cpus_per_worker=1.0, device="cpu", ready_timeout_s=120)
    settings.update(overrides)
    cfg = ClusterConfig(**settings)
    if fakes:
        sc = ServingCluster(cfg, prefill_actor_cls=router_fakes.FakePrefillWorker,
                            decode_actor_cls=router_fakes.FakeDecodeWorker,
                            form_transport_group=router_fakes.fake_transport_group)
    elif real_prefill:
        sc = ServingCluster(cfg, decode_actor_cls=router_fakes.real_decode_actor_class())
    else:
        sc = ServingCluster(cfg)
    sc.start_in_thread()
    wait_ready(sc.url)
    return sc


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready")


def wait_idle(sc, timeout_s: float = 15.0) -> list:
    """Waits until every decode worker holds no request and all its blocks are free; returns stats."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get([h.stats.remote() for h in sc.workers.decode.values()])
        if all(s.free_blocks == s.total_blocks and s.running == 0 and s.waiting == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"decode workers still busy: {stats}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def fake_cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, fakes=True, prefill_workers=1, decode_workers=2)
    yield sc
    sc.shutdown()


@pytest.fixture(scope="session")
def real_decode_cluster(ray_session, demo_model_dir):
    pytest.importorskip("decode_worker.actor")
    sc = start_cluster(demo_model_dir, fakes=False, prefill_workers=0, decode_workers=1, api_key="sekret")
    yield sc
    sc.shutdown()


@pytest.fixture(scope="session")
def real_pd_cluster(ray_session, demo_model_dir):
    """Real prefill and decode actors, KV over the real torch_dist (gloo) transport; prompts of at
    most 12 tokens are prefilled on the decode worker (conditional disaggregation)."""
    pytest.importorskip("prefill_worker.actor")
    pytest.importorskip("cluster.transport.factory")
    sc = start_cluster(demo_model_dir, fakes=False, real_prefill=True, prefill_workers=1, decode_workers=1,
                       local_prefill_threshold=12)
    yield sc
    sc.shutdown()


@pytest.fixture(scope="session")
def reference_engine(demo_model_dir):
    from cluster.engine import LLMEngine

    return LLMEngine(demo_model_dir, num_blocks=1024, max_num_seqs=64)
