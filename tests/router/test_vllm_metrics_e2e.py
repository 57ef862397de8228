"""A live /metrics of a real 1 prefill + 1 decode cluster has every series the Grafana dashboard in
deploy/grafana/pdserve.json queries (vLLM's dashboard's panels, then pdserve's), under vLLM's names
and its model_name label, and the values of the request phases add up (queue + prefill = TTFT)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "pdserve-demo"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
SERIES = re.compile(r"\b((?:vllm|pdserve):[a-zA-Z_][a-zA-Z0-9_]*)")
# The series vLLM's own dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries,
# under their current names (vllm:gpu_cache_usage_perc is vllm:kv_cache_usage_perc since vLLM v1).
VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}


def dashboard_series() -> set[str]:
    d = json.loads(DASHBOARD.read_text())
    return {name for p in d["panels"] for t in p["targets"] for name in SERIES.findall(t["expr"])}


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_the_dashboard_charts_vllms_panels():
    assert VLLM_DASHBOARD <= dashboard_series()


def test_live_metrics_have_every_series_the_dashboard_queries(real_pd_cluster):
    url = real_pd_cluster.url
    # The cluster is shared: the phases are compared over this test's own requests (an earlier
    # test's request aborted after its first token has a TTFT but no phases).
    before = samples(httpx.get(f"{url}/metrics").text)
    long = "Tell me a story about a dragon who lived in the mountains far away"
    for body in ({"prompt": long, "max_tokens": 6}, {"prompt": long + " again", "max_tokens": 5, "stream": True},
                 {"prompt": "Hi", "max_tokens": 4, "n": 2}):  # "Hi" is prefilled on its decode worker
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "frobnicate": 1})
    assert r.status_code == 400  # a refusal, counted by status
    # A request's phases are observed once its prefill worker's answer is in, which a stream's end can
    # beat (router/stats/request_records.py): look until the four are.
    deadline = time.monotonic() + 30
    while True:
        got = samples(httpx.get(f"{url}/metrics").text)
        done = sum(s.value for s in got.get("vllm:request_queue_time_seconds_count", ()))
        if done - sum(s.value for s in before.get("vllm:request_queue_time_seconds_count", ())) >= 4 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    missing = sorted(dashboard_series() - set(got))
    assert not missing, missing
    for name in VLLM_DASHBOARD:
        assert all(s.labels.get("model_name") == MODEL for s in got[name]), name
    total = lambda name, **labels: sum(s.value for s in got[name]  # noqa: E731
                                       if all(s.labels.get(k) == v for k, v in labels.items()))
    assert total("pdserve:prefill_placements_total", where="remote") >= 2
    assert total("pdserve:kv_transfer_bytes_total") > 0
    # both the disaggregated and the local requests have their phases; queue + prefill = TTFT
    assert total("vllm:request_queue_time_seconds_count") >= 4
    assert total("vllm:request_decode_time_seconds_count") == total("vllm:request_queue_time_seconds_count")
    since = lambda name: total(name) - sum(s.value for s in before.get(name, ()))  # noqa: E731
    assert since("vllm:request_queue_time_seconds_count") == since("vllm:time_to_first_token_seconds_count") == 4
    phases = since("vllm:request_queue_time_seconds_sum") + since("vllm:request_prefill_time_seconds_sum")
    ttft = since("vllm:time_to_first_token_seconds_sum")
    assert abs(phases - ttft) < 0.05 * ttft + 0.05
    assert total("vllm:request_params_n_sum") >= 2 + 1 + 1 and total("vllm:request_params_max_tokens_count") >= 3
    engines = {s.labels["engine"] for s in got["vllm:kv_cache_usage_perc"]}
    assert engines == set(real_pd_cluster.workers.decode)
    info = got["vllm:cache_config_info"]
    assert {s.labels["role"] for s in info} == {"prefill", "decode"}
    assert all(s.labels["block_size"] == "16" and s.labels["cache_dtype"] == "auto" and int(s.labels["num_gpu_blocks"]) > 0
               for s in info)
    assert total("pdserve:request_rejected_total", status="400") >= 1
