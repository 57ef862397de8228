"""Chaos, the short version of benchmarks/chaos.py: 8 greedy streams kept going on a real cluster
(1 prefill + 2 decode workers, KV over gloo) until two faults were made and their workers are back: a
random prefill or decode worker's process killed every 6 s (a decode worker only while the other one
is healthy) and Ray restarts it: no request hangs, none gets a 5xx or an error event, every one
equals the reference engine's greedy text, every restarted worker is back, and afterwards every KV
block is free on every worker (capacity back to full) with the block accounting intact."""

from __future__ import annotations

import json

import pytest

from benchmarks import chaos
from reliability_harness import start_cluster, wait_clean, worker_stats


@pytest.fixture(scope="module")
def cluster(ray_session, demo_model_dir):
    sc = start_cluster(demo_model_dir, prefill_workers=1, decode_workers=2, local_prefill_threshold=10,
                       cpu_num_blocks=128, worker_max_restarts=-1)
    yield sc
    sc.shutdown()


def test_chaos_short(cluster, reference_engine):
    full = sum(s.total_blocks for s in worker_stats(cluster).values())
    # Two faults, each watched until its victim is back; the 90 s only bound the load.
    result = chaos.run(cluster, reference_engine, duration_s=90, interval_s=6, streams=8, max_tokens=16,
                       deadline_s=90, settle_s=90, faults_wanted=2)
    s = result["summary"]
    print("\n" + json.dumps(s, indent=1))
    assert sum(s["by_fault"].get(k, {}).get("injected", 0) for k in ("prefill", "decode")) >= 2, s["by_fault"]
    assert s["requests"] > 0 and s["hung"] == 0 and s["http_5xx"] == 0 and s["errors_returned"] == 0
    assert s["finished_exactly"] == s["requests"], result["not_exact"][:3]
    assert all(k["not_back"] == 0 for k in s["by_fault"].values())
    assert s["blocks_leaked"] == 0 and s["seconds_to_full_capacity_after_load"] is not None
    stats = wait_clean(cluster)
    assert sum(stats[w].total_blocks for w in cluster.workers.decode) == full
