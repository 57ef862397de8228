"""Fixtures of the router/gateway tests: the run's one Ray, clusters built by the real launcher and
shared by every module that uses them (tests/cluster_cache.py).

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


# Module-scoped handles on clusters the cache keeps for the whole group of modules that use them.
@pytest.fixture(scope="module", params=[1, 2], ids=["api1", "api2"])
def fake_cluster(ray_session, cluster_cache, demo_model_dir, request):
    return _shared(cluster_cache, demo_model_dir, fakes=True, prefill_workers=1, decode_workers=2,
                   api_servers=request.param)


@pytest.fixture(scope="module")
def real_decode_cluster(ray_session, cluster_cache, demo_model_dir):
    pytest.importorskip("decode_worker.actor")
    return _shared(cluster_cache, demo_model_dir, fakes=False, prefill_workers=0, decode_workers=1, api_key="sekret")


@pytest.fixture(scope="module")
def real_pd_cluster(ray_session, cluster_cache, demo_model_dir):
    """Real prefill and decode actors, KV over the real torch_dist (gloo) transport; prompts of at
    most 12 tokens are prefilled on the decode worker (conditional disaggregation)."""
    pytest.importorskip("prefill_worker.actor")
    pytest.importorskip("cluster.transport.factory")
    return _shared(cluster_cache, demo_model_dir, fakes=False, real_prefill=True, prefill_workers=1,
                   decode_workers=1, local_prefill_threshold=12)


def _shared(cache, demo_model_dir, **settings):
    """The cluster of these settings, started once (tests/cluster_cache.py); its tests leave it whole."""
    return cache.get(tuple(sorted(settings.items())), lambda: start_cluster(demo_model_dir, **settings))
