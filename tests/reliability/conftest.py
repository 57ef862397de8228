"""Fixtures of the reliability tests (see reliability_harness.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_module():
    ray = pytest.importorskip("ray")
    from reliability_harness import init_ray

    owned = init_ray()
    yield ray
    if owned:
        ray.shutdown()


@pytest.fixture(scope="session")
def reference_engine(demo_model_dir):
    from cluster.engine import LLMEngine

    return LLMEngine(demo_model_dir, num_blocks=1024, max_num_seqs=64)
