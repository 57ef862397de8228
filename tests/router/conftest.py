"""Fixtures of the router/gateway tests: one Ray session, clusters built by the real launcher.

End-to-end clusters run real Ray actors, the real router and the API-server processes under uvicorn
on 127.0.0.1, and are reached over real HTTP. `fake_cluster` uses the worker doubles of
router_fakes.py (1 prefill + 2 decode, disaggregated path), once with one API server and once with
two sharing the port (each with its own token stream); `real_decode_cluster` uses the real DecodeWorkerActor with every
prompt prefilled on it (prefill_workers=0), which needs no KV transport.
"""

from __future__ import annotations

import pytest

import router_fakes
from router_clusters import start_cluster


@pytest.fixture(scope="session")
def ray_session(ray_session):
    """The run's one Ray (tests/conftest.py), with the worker doubles shipped by value: they live in a
    test directory Ray's workers can't import."""
    ray_session.cloudpickle.register_pickle_by_value(router_fakes)
    return ray_session


@pytest.fixture(scope="session", params=[1, 2], ids=["api1", "api2"])
def fake_cluster(ray_session, demo_model_dir, request):
    sc = start_cluster(demo_model_dir, fakes=True, prefill_workers=1, decode_workers=2, api_servers=request.param)
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
