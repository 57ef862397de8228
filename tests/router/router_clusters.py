"""Clusters for the router/gateway tests, built by the real launcher: with the worker doubles of
router_fakes.py, with the real decode actor only, or all real.

A module of its own (not conftest.py): test files import it by a name no other test directory uses
(`from conftest import ...` resolves to whichever conftest pytest imported last).
"""

from __future__ import annotations

import router_fakes
import serving_harness


def start_cluster(demo_model_dir, fakes: bool, real_prefill: bool = False, **overrides):
    if fakes:
        return serving_harness.start_cluster(
            demo_model_dir, prefill_actor_cls=router_fakes.FakePrefillWorker,
            decode_actor_cls=router_fakes.FakeDecodeWorker, form_transport_group=router_fakes.fake_transport_group,
            **overrides)
    if real_prefill:
        return serving_harness.start_cluster(demo_model_dir, decode_actor_cls=router_fakes.real_decode_actor_class(),
                                             **overrides)
    return serving_harness.start_cluster(demo_model_dir, **overrides)
