"""Prometheus metrics of the gateways and the router, named like vLLM's with a `pdserve:` prefix.

Two sets, each observed where its facts are:
- `GatewayMetrics`, in every gateway (API-server) process: request latencies (TTFT, ITL, end to end),
  streamed tokens, finished and refused requests. With several gateway processes each writes its own
  file under PROMETHEUS_MULTIPROC_DIR (set by the launcher) and `/metrics` on any of them sums all.
- `RouterMetrics`, in the router's process: prefill/transfer timings (from `PrefillResult`s), decode
  steps (from the workers' step records), migrations, placements, and the gauges from the workers'
  polled `WorkerStats`. A gateway's `/metrics` appends the router's text, fetched over its channel.

Each instance has its own registry, so several clusters can live in one process (tests).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.messages import WorkerStats
from cluster.stream_messages import DecodeStepRecord

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

    def _hist(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(f"pdserve:{name}", doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"pdserve:{name}", doc, ["model_name"], registry=self.registry).labels(self.model_name)


def _frames_rejected_counter(registry) -> Counter:
    return Counter("pdserve:frames_rejected", "Frames dropped on the cluster's own sockets for a missing or bad MAC "
                   "(not from a holder of the cluster's secret, or replayed), by channel.",
                   ["model_name", "channel"], registry=registry)


class GatewayMetrics(_Metrics):
    def __init__(self, model_name: str):
        super().__init__(model_name)
        self.ttft = self._hist("time_to_first_token_seconds", "Time from arrival to the first token.",
                               _LATENCY_BUCKETS)
        self.itl = self._hist("inter_token_latency_seconds", "Time between two tokens of a request.",
                              _LATENCY_BUCKETS)
        self.e2e = self._hist("e2e_request_latency_seconds", "Time from arrival to the last token.",
                              _LATENCY_BUCKETS)
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens streamed to clients.")
        self.request_prompt_tokens = self._hist("request_prompt_tokens", "Prompt tokens of a finished request.",
                                                _TOKEN_BUCKETS)
        self.request_generation_tokens = self._hist("request_generation_tokens",
                                                    "Generated tokens of a finished request.", _TOKEN_BUCKETS)
        self._success = Counter("pdserve:request_success", "Finished requests by finish reason.",
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
        """A frame on one of the cluster's own sockets without a valid MAC (cluster/frame_auth.py)."""
        self._frames_rejected.labels(self.model_name, channel).inc()

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
    def __init__(self, model_name: str):
        super().__init__(model_name)
        r, m = self.registry, ["model_name"]
        self.queue = self._hist("request_queue_time_seconds", "Time a request waited in a prefill queue.",
                                _LATENCY_BUCKETS)
        self.prefill = self._hist("request_prefill_time_seconds", "Time a prefill worker computed the prompt.",
                                  _LATENCY_BUCKETS)
        self.kv_transfer = self._hist("kv_transfer_seconds", "Time the prompt's KV took from prefill to decode.",
                                      _LATENCY_BUCKETS)
        self.kv_transfer_size = self._hist("kv_transfer_size_bytes", "Bytes of KV moved per request.", _BYTES_BUCKETS)
        self.decode_step = self._hist("decode_step_seconds", "Duration of one decode step.", _LATENCY_BUCKETS)
        self.decode_batch_size = self._hist("decode_batch_size", "Requests in one decode step.", _BATCH_BUCKETS)
        self.graph_padding_ratio = self._hist("graph_padding_ratio", "Padded rows / graph bucket size per replayed step.",
                                              _RATIO_BUCKETS)
        self.kv_transfer_bytes = self._counter("kv_transfer_bytes", "KV bytes moved prefill -> decode.")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.local_prefills = self._counter("local_prefill_requests",
                                            "Requests prefilled on their decode worker (conditional disaggregation).")
        self.reserve_retries = self._counter("reserve_retries", "Reservations a decode worker refused.")
        self._prefill_placements = Counter(
            "pdserve:prefill_placements", "Where prompts were prefilled (local: on their decode worker) and why.",
            m + ["where", "reason"], registry=r)
        self.role_switches = self._counter("worker_role_switches",
                                           "Workers the P:D planner moved between prefill and decode.")
        self.migrations = self._counter("request_migrations", "Requests moved to another worker after theirs died.")
        self.running = Gauge("pdserve:num_requests_running", "Requests decoding on decode workers.", m,
                             registry=r).labels(self.model_name)
        self.waiting = Gauge("pdserve:num_requests_waiting",
                             "Requests in the admission queue, waiting for KV and prefill capacity.", m,
                             registry=r).labels(self.model_name)
        self.admission_queue_time = self._hist(
            "request_admission_queue_time_seconds",
            "Time a request waited in the admission queue before it was admitted (0: at once).", _LATENCY_BUCKETS)
        self._kv_usage = Gauge("pdserve:kv_cache_usage_perc", "KV-cache usage of a decode worker (1 = full).",
                               m + ["worker_id"], registry=r)
        self.kv_usage_total = Gauge("pdserve:kv_cache_usage_perc_cluster",
                                    "KV-cache usage over every healthy decode worker: used / total blocks.", m,
                                    registry=r).labels(self.model_name)
        self._kv_blocks: dict[str, tuple[int, int]] = {}  # decode worker -> (used, total) last polled
        self.preemptions = self._counter("num_preemptions", "Decode requests preempted (KV recomputed later).")
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
        self._prefix_queries = Counter("pdserve:prefix_cache_queries", "Prefix cache queries, in prompt tokens.",
                                       m + ["worker_id", "role"], registry=r)
        self._prefix_hits = Counter("pdserve:prefix_cache_hits", "Prefix cache hits, in prompt tokens.",
                                    m + ["worker_id", "role"], registry=r)
        self._prefix_hit_rate = Gauge("pdserve:prefix_cache_hit_rate",
                                      "Prefix cache hits / queries since start, over all workers of a role.",
                                      m + ["role"], registry=r)
        self._prefix_seen: dict[str, tuple[str, int, int]] = {}  # worker -> (role, queries, hits) last polled
        self._frames_rejected = _frames_rejected_counter(r)
        self._kv_rejected_seen: dict[str, int] = {}  # decode worker -> its KV control inbox's drops last polled

    def observe_step(self, rec: DecodeStepRecord) -> None:
        if rec.step_time_s > 0:
            self.decode_step.observe(rec.step_time_s)
        if rec.batch_size > 0:
            self.decode_batch_size.observe(rec.batch_size)
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
        if stats is not None and "kv_frames_rejected" in stats.extra:
            n, seen = stats.extra["kv_frames_rejected"], self._kv_rejected_seen.get(worker_id, 0)
            self.frame_rejected("kv_control", n - seen if n >= seen else n)  # (less: a new incarnation)
            self._kv_rejected_seen[worker_id] = n
        if stats is not None and "prefix_cache_queries" in stats.extra:
            self._observe_prefix_cache(worker_id, role, stats.extra["prefix_cache_queries"],
                                       stats.extra["prefix_cache_hits"])

    def forget_worker(self, worker_id: str, role: str) -> None:
        """A worker taken out of service (a role switch): its series go."""
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
