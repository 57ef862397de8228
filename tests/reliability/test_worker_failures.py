"""Worker failures that the first round of fault tests did not cover, on a real cluster (1 prefill + 2
decode workers, KV over gloo, small KV pools):

- a decode loop that raises while its process lives: its requests are treated like a dead worker's
  (moved as prompt + tokens so far, same seed: every stream equals the reference, no error event), the
  loop restarts and the worker keeps serving with every block accounted for;
- the prefill worker killed with a full queue whose reservations hold most of the decode pools: the
  blocks reserved for the dead peer come back as soon as the router hears of the death (not after the
  transport's heartbeat timeout), every request is placed again and finishes exactly."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.sampling.sampling_params import SamplingParams
from reliability_harness import start_cluster, wait_clean
from test_worker_death import _busiest, _kill, _prompts, _run_and_kill, _serves


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=2, local_prefill_threshold=10,
                       cpu_num_blocks=80)
    yield sc
    sc.shutdown()


def _refs(engine, prompts, n):
    return [r.text for r in engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)]
                                            * len(prompts))]


def test_decode_loop_exception_migrates_its_requests(cluster, reference_engine):
    import ray

    prompts = _prompts(6, 4) + _prompts(4, 30)  # local prefill and disaggregated
    n = 40
    refs = _refs(reference_engine, prompts, n)
    victim = {}

    def fail_loop():
        victim["id"] = _busiest(cluster, "decode")
        victim["held"] = len(cluster.router.views[victim["id"]].inflight)
        ray.get(cluster.workers.decode[victim["id"]].inject_fault.remote("loop"))

    before = cluster.router.metrics.migrations._value.get()
    out = asyncio.run(_run_and_kill(cluster, prompts, n, fail_loop, when=lambda k: k >= 60))
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:3]
    assert victim["held"] > 0
    assert [t for t, _ in out] == refs
    moved = cluster.router.metrics.migrations._value.get() - before
    print(f"\nloop exception on {victim['id']} holding {victim['held']}: {moved:.0f} moved, all exact")
    assert moved >= victim["held"]
    st = ray.get(cluster.workers.decode[victim["id"]].stats.remote())
    assert st.healthy and st.extra["loop_failures"] == 1 and st.extra["error"] is None
    _serves(cluster)
    wait_clean(cluster)


def test_prefill_death_releases_reserved_blocks_and_every_request_is_placed_again(cluster, reference_engine):
    prompts = _prompts(10, 50)  # above the local threshold: each reserves ~5 blocks of a 79-block pool
    n = 8
    refs = _refs(reference_engine, prompts, n)
    router = cluster.router
    held = {}

    def kill():
        held["n"] = len(router.views["prefill-0"].inflight)
        held["t"] = time.monotonic()
        _kill(cluster, "prefill-0")

    t0 = time.monotonic()
    out = asyncio.run(_run_and_kill(cluster, prompts, n, kill,
                                    when=lambda k: len(router.views["prefill-0"].inflight) >= 6 or k > 0))
    errors = [ev for _, evs in out for ev in evs if "error" in ev]
    assert not errors, errors[:2]
    assert [t for t, _ in out] == refs
    print(f"\nprefill death with {held['n']} queued: all {len(prompts)} exact, "
          f"done {time.monotonic() - held['t']:.1f}s after the kill ({time.monotonic() - t0:.1f}s in all)")
    assert held["n"] > 0
    # Well inside the transport's heartbeat timeout (10 s): the reserved blocks came back at once.
    wait_clean(cluster, roles=("decode",), timeout_s=8)
    _serves(cluster)
