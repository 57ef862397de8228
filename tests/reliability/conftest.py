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
