"""Prometheus metrics of the gateways and the router, under vLLM's names and labels.

A series vLLM has keeps vLLM's name (`vllm:` prefix), meaning and labels (`model_name`; `engine`
for a per-worker series, its value the worker id), so a dashboard written for vLLM reads pdserve
as it is (deploy/grafana/pdserve.json is vLLM's dashboard plus pdserve's own panels; the series it
queries are checked against a live /metrics by tests/router/test_vllm_metrics_e2e.py). What vLLM has
no name for keeps a `pdserve:` prefix: prefill placement, KV transfer, decode steps and graph padding,
prefix-cache hit rate per role, worker health and pass costs, migrations, refusals by status, the
cluster-wide KV usage. One set of names, not two behind a flag: a scraper never has to be told which.

Two sets, each observed where its facts are:
- `GatewayMetrics`, in every gateway (API-server) process: request latencies (TTFT, ITL = TPOT, end to
  end), streamed tokens, finished and refused requests, the requests' n and max_tokens. With several
  gateway processes each writes its own file under PROMETHEUS_MULTIPROC_DIR (set by the launcher)
  and `/metrics` on any of them sums all.
- `RouterMetrics`, in the router's process: the request phases (queue, prefill, decode, inference;
  on finish), prefill/transfer timings (from `PrefillResult`s), decode steps (from the workers' step
  records), migrations, placements, and the gauges from the workers' polled `WorkerStats`. A
  gateway's `/metrics` appends the router's text, fetched over its channel.

Each instance has its own registry, so several clusters can live in one process (tests).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.wire.messages import PrefillTimeline, WorkerStats
from cluster.wire.stream_messages import DecodeStepRecord
from router.stats.step_stats import TTFTPoints

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n buckets

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

    def _hist(self, name: str, doc: str, buckets) -> Histogram:
        """`name` with its prefix: vllm:... for vLLM's series, pdserve:... for ours."""
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)


class _Tee:
    """One observation into several histograms: vLLM records every inter-token interval both as
    inter_token_latency_seconds and as time_per_output_token_seconds (the older name dashboards read)."""

    def __init__(self, *hists):
        self.hists = hists

    def observe(self, v: float) -> None:
        for h in self.hists:
            h.observe(v)


# The workers' own sockets whose dropped frames their stats report: stats key -> channel label.
_WORKER_CHANNELS = {"kv_frames_rejected": "kv_control", "dispatch_frames_rejected": "prefill_dispatch"}


def _frames_rejected_counter(registry) -> Counter:
    return Counter("pdserve:frames_rejected", "Frames dropped on the cluster's own sockets for a missing or bad MAC "
                   "(not from a holder of the cluster's secret, or replayed), by channel.",
                   ["model_name", "channel"], registry=registry)


class GatewayMetrics(_Metrics):
    def __init__(self, model_name: str):
        super().__init__(model_name)
        self.ttft = self._hist("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                               _LATENCY_BUCKETS)
        self.itl = _Tee(
            self._hist("vllm:inter_token_latency_seconds", "Time between two tokens of a request.", _LATENCY_BUCKETS),
            self._hist("vllm:time_per_output_token_seconds", "Time between two tokens of a request (vLLM's "
                       "older name of inter_token_latency_seconds, the same observations).", _LATENCY_BUCKETS))
        self.e2e = self._hist("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                              _LATENCY_BUCKETS)
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens streamed to clients.")
        self.request_prompt_tokens = self._hist("vllm:request_prompt_tokens", "Prompt tokens of a finished request.",
                                                _TOKEN_BUCKETS)
        self.request_generation_tokens = self._hist("vllm:request_generation_tokens",
                                                    "Generated tokens of a finished request.", _TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = self._hist(
            "vllm:request_max_num_generation_tokens", "Most tokens generated by one of a prompt's n choices.",
            _TOKEN_BUCKETS)
        self.request_params_n = self._hist("vllm:request_params_n", "The n (choices) of a request's prompt.",
                                           _N_BUCKETS)
        self.request_params_max_tokens = self._hist("vllm:request_params_max_tokens",
                                                    "The max_tokens a request's prompt was served with.",
                                                    _TOKEN_BUCKETS)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter("pdserve:request_rejected", "Requests refused, by HTTP status.",
                                 ["model_name", "status"], registry=self.registry)
        self._frames_rejected = _frames_rejected_counter(self.registry)

    def finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def frame_rejected(self, channel: str) -> None:
        """A frame on one of the cluster's own sockets without a valid MAC (cluster/wire/frame_auth.py)."""
        self._frames_rejected.labels(self.model_name, channel).inc()
    def prompt_placed(self, n: int, max_tokens: int) -> None:
        """One prompt of a request was admitted with its n choices (vLLM counts each prompt a request)."""
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)

    def render(self) -> bytes:
        """Every gateway process's metrics summed (multiprocess mode), else this one's."""
        path = os.environ.get(MULTIPROC_ENV)
        if not path:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        return generate_latest(registry)


class RouterMetrics(_Metrics):
    def __init__(self, model_name: str, cache_config: dict[str, Any] | None = None,
                 precision: dict[str, str] | None = None):
        """cache_config: the KV cache settings vllm:cache_config_info reports per worker (block_size,
        cache_dtype, enable_prefix_caching, gpu_memory_utilization); the worker adds its num_gpu_blocks.
        precision: what the model is served with (dtype, quantization, kv_cache_dtype), the labels of
        pdserve:model_info."""
        super().__init__(model_name)
        r, m = self.registry, ["model_name"]
        if precision:
            Gauge("pdserve:model_info", "What the model is served with: activation dtype, quantization, KV cache "
                  "dtype (value 1).", m + sorted(precision), registry=r).labels(
                      model_name, *(precision[k] for k in sorted(precision))).set(1.0)
        self.cache_config = {k: str(v) for k, v in (cache_config or {}).items()}
        # The phases of a finished request, as vLLM splits them: queue (arrival -> its prefill
        # starts), prefill (-> first token; on a prefill worker this includes the KV transfer, which
        # pdserve:kv_transfer_seconds has alone), decode (first -> last token), inference (prefill +
        # decode). queue + prefill = TTFT.
        self.queue = self._hist("vllm:request_queue_time_seconds", "Time from arrival until the prompt's prefill "
                                "started (admission, placement, the prefill queue).", _LATENCY_BUCKETS)
        self.prefill = self._hist("vllm:request_prefill_time_seconds", "Time from the prefill's start to the first "
                                  "token.", _LATENCY_BUCKETS)
        self.decode = self._hist("vllm:request_decode_time_seconds", "Time from the first to the last token.",
                                 _LATENCY_BUCKETS)
        self.inference = self._hist("vllm:request_inference_time_seconds", "Time from the prefill's start to the "
                                    "last token (prefill + decode).", _LATENCY_BUCKETS)
        self.iteration_tokens = self._hist("vllm:iteration_tokens_total", "Tokens one decode step computed "
                                           "(its batch).", _BATCH_BUCKETS)
        self.kv_transfer = self._hist("pdserve:kv_transfer_seconds", "Time the prompt's KV took from prefill to "
                                      "decode.", _LATENCY_BUCKETS)
        self.kv_transfer_size = self._hist("pdserve:kv_transfer_size_bytes", "Bytes of KV moved per request.",
                                           _BYTES_BUCKETS)
        self.decode_step = self._hist("pdserve:decode_step_seconds", "Duration of one decode step.", _LATENCY_BUCKETS)
        self.decode_batch_size = self._hist("pdserve:decode_batch_size", "Requests in one decode step.", _BATCH_BUCKETS)
        self.graph_padding_ratio = self._hist("pdserve:graph_padding_ratio",
                                              "Padded rows / graph bucket size per replayed step.", _RATIO_BUCKETS)
        self.kv_transfer_bytes = self._counter("pdserve:kv_transfer_bytes", "KV bytes moved prefill -> decode.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.")
        self.local_prefills = self._counter("pdserve:local_prefill_requests",
                                            "Requests prefilled on their decode worker (conditional disaggregation).")
        self.reserve_retries = self._counter("pdserve:reserve_retries", "Reservations a decode worker refused.")
        self._prefill_placements = Counter(
            "pdserve:prefill_placements", "Where prompts were prefilled (local: on their decode worker) and why.",
            m + ["where", "reason"], registry=r)
        self.role_switches = self._counter("pdserve:worker_role_switches",
                                           "Workers the P:D planner moved between prefill and decode.")
        self.migrations = self._counter("pdserve:request_migrations",
                                        "Requests moved to another worker after theirs died.")
        self.records_without_prefill_answer = self._counter(
            "pdserve:request_records_without_prefill_answer",
            "Finished requests recorded without their prefill worker's answer (lost, or later than "
            "router.stats.request_records.ANSWER_WAIT_S): their queue/prefill phases and TTFT parts lack the "
            "prefill worker's timeline.")
        self.running = Gauge("vllm:num_requests_running", "Requests decoding on decode workers.", m,
                             registry=r).labels(self.model_name)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests in the admission queue, waiting for KV and prefill capacity.", m,
                             registry=r).labels(self.model_name)
        self.admission_queue_time = self._hist(
            "pdserve:request_admission_queue_time_seconds",
            "Time a request waited in the admission queue before it was admitted (0: at once).", _LATENCY_BUCKETS)
        self._kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage of a decode worker (1 = full).",
                               m + ["engine"], registry=r)
        self.kv_usage_total = Gauge("pdserve:kv_cache_usage_perc_cluster",
                                    "KV-cache usage over every healthy decode worker: used / total blocks.", m,
                                    registry=r).labels(self.model_name)
        self._cache_info = Gauge("vllm:cache_config_info", "A worker's KV cache configuration (value 1).",
                                 m + ["engine", "role", "num_gpu_blocks", *sorted(self.cache_config)], registry=r)
        self._cache_info_labels: dict[str, tuple[str, ...]] = {}  # worker -> its info labels
        self._kv_blocks: dict[str, tuple[int, int]] = {}  # decode worker -> (used, total) last polled
        self.preemptions = self._counter("vllm:num_preemptions", "Decode requests preempted (KV recomputed later).")
        self._preempt_seen: dict[str, int] = {}  # decode worker -> its preemptions total last polled
        self._healthy = Gauge("pdserve:worker_healthy", "1 when the worker answered its last stats poll.",
                              m + ["worker_id", "role"], registry=r)
        self._gone = Gauge("pdserve:worker_gone",
                           "1 when the worker died past its restart limit (worker_max_restarts): it is not "
                           "coming back.",
                           m + ["worker_id", "role"], registry=r)
        self._pass_cost = Gauge(
            "pdserve:worker_pass_cost_seconds",
            "A worker's measured pass cost, seconds = overhead + units x per_unit (pass=prefill: per prompt token, "
            "on a decode worker its local prefill; pass=decode: per batch row).",
            m + ["worker_id", "pass", "term"], registry=r)
        # Prefix cache, as vLLM counts it: prompt tokens looked up, and those found (per worker; a
        # prefill worker's hits are tokens not computed, a decode worker's are KV not transferred).
        self._prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens.",
                                       m + ["engine", "role"], registry=r)
        self._prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens.",
                                    m + ["engine", "role"], registry=r)
        self._prefix_hit_rate = Gauge("pdserve:prefix_cache_hit_rate",
                                      "Prefix cache hits / queries since start, over all workers of a role.",
                                      m + ["role"], registry=r)
        self._prefix_seen: dict[str, tuple[str, int, int]] = {}  # worker -> (role, queries, hits) last polled
        self._frames_rejected = _frames_rejected_counter(r)
        # (worker, its stats key) -> the drops of that socket last polled (_WORKER_CHANNELS)
        self._rejected_seen: dict[tuple[str, str], int] = {}

    def request_finished(self, points: TTFTPoints, finished: float, timeline: PrefillTimeline | None) -> None:
        """A request its gateway finished (not aborted): its phases, split where its prefill started
        (TTFTPoints.prefill_start; `timeline`: its prefill worker's, None when prefilled on its
        decode worker)."""
        if points.first_token is None:
            return
        prefill_start = points.prefill_start(timeline)
        self.queue.observe(prefill_start - points.arrival)
        self.prefill.observe(points.first_token - prefill_start)
        self.decode.observe(max(0.0, finished - points.first_token))
        self.inference.observe(max(0.0, finished - prefill_start))

    def observe_step(self, rec: DecodeStepRecord) -> None:
        if rec.step_time_s > 0:
            self.decode_step.observe(rec.step_time_s)
        if rec.batch_size > 0:
            self.decode_batch_size.observe(rec.batch_size)
            self.iteration_tokens.observe(rec.batch_size)
            if rec.bucket > 0:
                self.graph_padding_ratio.observe(max(0, rec.bucket - rec.batch_size) / rec.bucket)

    def worker_gone(self, worker_id: str, role: str, gone: bool = True) -> None:
        self._gone.labels(self.model_name, worker_id, role).set(1.0 if gone else 0.0)

    def frame_rejected(self, channel: str, n: int = 1) -> None:
        """Frames dropped on one of the cluster's own sockets for a missing or bad MAC."""
        if n > 0:
            self._frames_rejected.labels(self.model_name, channel).inc(n)

    def prefill_placed(self, where: str, reason: str) -> None:
        self._prefill_placements.labels(self.model_name, where, reason).inc()

    def observe_worker(self, stats: WorkerStats | None, worker_id: str, role: str, healthy: bool) -> None:
        self._healthy.labels(self.model_name, worker_id, role).set(1.0 if healthy else 0.0)
        if not healthy:
            # A dead worker's last KV usage is no measurement: the series goes until it answers again.
            self._remove(self._kv_usage, worker_id)
            self._kv_blocks.pop(worker_id, None)
        elif stats is not None and role == "decode" and stats.total_blocks > 0:
            self._kv_usage.labels(self.model_name, worker_id).set(1.0 - stats.free_blocks / stats.total_blocks)
            self._kv_blocks[worker_id] = (stats.total_blocks - stats.free_blocks, stats.total_blocks)
        if healthy and stats is not None and stats.total_blocks > 0:
            self._set_cache_info(worker_id, role, stats.total_blocks)
        self._set_kv_usage_total()
        if stats is not None and role == "decode" and "preemptions" in stats.extra:
            # Totals since the worker started: the counter advances by the difference (by the whole
            # total when it went down: a new worker under the same id).
            n, seen = stats.extra["preemptions"], self._preempt_seen.get(worker_id, 0)
            self.preemptions.inc(max(0, n - seen if n >= seen else n))
            self._preempt_seen[worker_id] = n
        if healthy and stats is not None:
            for kind, rate in (("prefill", stats.prefill_rate), ("decode", stats.decode_rate)):
                if rate is not None:
                    self._pass_cost.labels(self.model_name, worker_id, kind, "overhead").set(rate.overhead_s)
                    self._pass_cost.labels(self.model_name, worker_id, kind, "per_unit").set(rate.unit_s)
        for key, channel in _WORKER_CHANNELS.items():
            if stats is not None and key in stats.extra:
                n, seen = stats.extra[key], self._rejected_seen.get((worker_id, key), 0)
                self.frame_rejected(channel, n - seen if n >= seen else n)  # (less: a new incarnation)
                self._rejected_seen[worker_id, key] = n
        if stats is not None and "prefix_cache_queries" in stats.extra:
            self._observe_prefix_cache(worker_id, role, stats.extra["prefix_cache_queries"],
                                       stats.extra["prefix_cache_hits"])

    def _set_cache_info(self, worker_id: str, role: str, num_blocks: int) -> None:
        labels = (worker_id, role, str(num_blocks), *(self.cache_config[k] for k in sorted(self.cache_config)))
        old = self._cache_info_labels.get(worker_id)
        if old == labels:
            return
        if old is not None:  # a restarted worker may size its pool anew
            self._remove(self._cache_info, *old)
        self._cache_info.labels(self.model_name, *labels).set(1.0)
        self._cache_info_labels[worker_id] = labels

    def forget_worker(self, worker_id: str, role: str) -> None:
        """A worker taken out of service (a role switch): its series go."""
        old = self._cache_info_labels.pop(worker_id, None)
        if old is not None:
            self._remove(self._cache_info, *old)
        self._remove(self._kv_usage, worker_id)
        self._kv_blocks.pop(worker_id, None)
        self._set_kv_usage_total()
        self._remove(self._healthy, worker_id, role)
        for kind in ("prefill", "decode"):
            for term in ("overhead", "per_unit"):
                self._remove(self._pass_cost, worker_id, kind, term)
        self._remove(self._prefix_queries, worker_id, role)
        self._remove(self._prefix_hits, worker_id, role)
        if self._prefix_seen.pop(worker_id, None) is not None:  # the hit rate is over the serving workers
            q = sum(x[1] for x in self._prefix_seen.values() if x[0] == role)
            h = sum(x[2] for x in self._prefix_seen.values() if x[0] == role)
            self._prefix_hit_rate.labels(self.model_name, role).set(h / q if q else 0.0)

    def _set_kv_usage_total(self) -> None:
        used = sum(u for u, _ in self._kv_blocks.values())
        total = sum(t for _, t in self._kv_blocks.values())
        self.kv_usage_total.set(used / total if total else 0.0)

    def _remove(self, metric, *labels: str) -> None:
        try:
            metric.remove(self.model_name, *labels)
        except KeyError:
            pass

    def _observe_prefix_cache(self, worker_id: str, role: str, queries: int, hits: int) -> None:
        """The workers report totals since they started: the counters advance by the difference (by
        the whole total when it went down: a new worker under the same id)."""
        _, q0, h0 = self._prefix_seen.get(worker_id, (role, 0, 0))
        dq, dh = (queries - q0, hits - h0) if queries >= q0 else (queries, hits)
        self._prefix_queries.labels(self.model_name, worker_id, role).inc(max(0, dq))
        self._prefix_hits.labels(self.model_name, worker_id, role).inc(max(0, dh))
        self._prefix_seen[worker_id] = (role, queries, hits)
        q = sum(x[1] for x in self._prefix_seen.values() if x[0] == role)
        h = sum(x[2] for x in self._prefix_seen.values() if x[0] == role)
        self._prefix_hit_rate.labels(self.model_name, role).set(h / q if q else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
