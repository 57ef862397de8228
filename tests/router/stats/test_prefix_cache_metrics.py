"""Prefix-cache metrics on /metrics from the workers' polled totals: per worker, and the hit rate over
all workers of a role."""

from cluster.wire.messages import WorkerStats
from loadtest.server_stats import parse_counter_totals
from router.stats.metrics import RouterMetrics


def stats(wid, role, queries, hits):
    return WorkerStats(wid, role, extra={"prefix_cache_queries": queries, "prefix_cache_hits": hits})


def test_counters_advance_by_the_polled_totals():
    m = RouterMetrics("demo")
    m.observe_worker(stats("p0", "prefill", 100, 40), "p0", "prefill", True)
    m.observe_worker(stats("p0", "prefill", 300, 200), "p0", "prefill", True)
    m.observe_worker(stats("p1", "prefill", 100, 0), "p1", "prefill", True)
    m.observe_worker(stats("d0", "decode", 50, 25), "d0", "decode", True)
    m.observe_worker(WorkerStats("x", "decode"), "x", "decode", True)  # a worker without a prefix cache
    text = m.render().decode()
    assert 'vllm:prefix_cache_queries_total{engine="p0",model_name="demo",role="prefill"} 300.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="p0",model_name="demo",role="prefill"} 200.0' in text
    totals = parse_counter_totals(text, ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"])
    assert totals == {"vllm:prefix_cache_queries_total": 450.0, "vllm:prefix_cache_hits_total": 225.0}
    assert 'pdserve:prefix_cache_hit_rate{model_name="demo",role="prefill"} 0.5' in text
    assert 'pdserve:prefix_cache_hit_rate{model_name="demo",role="decode"} 0.5' in text
    # A new worker under the same id starts from zero: its totals count again, nothing goes backwards.
    m.observe_worker(stats("p0", "prefill", 10, 10), "p0", "prefill", True)
    text = m.render().decode()
    assert 'vllm:prefix_cache_queries_total{engine="p0",model_name="demo",role="prefill"} 310.0' in text
