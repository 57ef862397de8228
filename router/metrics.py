"""Prometheus metrics of the gateway and router, named like vLLM's with a `pdserve:` prefix.

One `ServingMetrics` per gateway, on its own registry (so several gateways can live in one process,
as in tests). Request-level latencies are observed by the gateway, prefill/transfer timings from
`PrefillResult`s by the router, step-level ones from the token stream's `TokenBatch`es, and gauges
from the workers' polled `WorkerStats`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.messages import TokenBatch, WorkerStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of a request.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited in a prefill queue.", _LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time a prefill worker computed the prompt.",
                            _LATENCY_BUCKETS)
        self.kv_transfer = hist("kv_transfer_seconds", "Time the prompt's KV took from prefill to decode.",
                                _LATENCY_BUCKETS)
        self.kv_transfer_size = hist("kv_transfer_size_bytes", "Bytes of KV moved per request.", _BYTES_BUCKETS)
        self.decode_step = hist("decode_step_seconds", "Duration of one decode step.", _LATENCY_BUCKETS)
        self.decode_batch_size = hist("decode_batch_size", "Requests in one decode step.", _BATCH_BUCKETS)
        self.graph_padding_ratio = hist("graph_padding_ratio", "Padded rows / graph bucket size per replayed step.",
                                        _RATIO_BUCKETS)
        self.prompt_tokens_hist = hist("request_prompt_tokens", "Prompt length of finished requests.",
                                       _BYTES_BUCKETS)
        self.kv_transfer_bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes moved prefill -> decode.", m,
                                         registry=r).labels(model_name)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of admitted requests.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens streamed to clients.", m,
                                         registry=r).labels(model_name)
        self._success = Counter("pdserve:request_success", "Finished requests by finish reason.",
                                m + ["finished_reason"], registry=r)
        self._rejected = Counter("pdserve:request_rejected", "Requests refused, by HTTP status.", m + ["status"],
                                 registry=r)
        self.local_prefills = Counter("pdserve:local_prefill_requests",
                                      "Requests prefilled on their decode worker (conditional disaggregation).",
                                      m, registry=r).labels(model_name)
        self.reserve_retries = Counter("pdserve:reserve_retries", "Reservations a decode worker refused.", m,
                                       registry=r).labels(model_name)
        self.migrations = Counter("pdserve:request_migrations",
                                  "Requests moved to another worker after theirs died.", m,
                                  registry=r).labels(model_name)
        self.running = Gauge("pdserve:num_requests_running", "Requests decoding on decode workers.", m,
                             registry=r).labels(model_name)
        self.waiting = Gauge("pdserve:num_requests_waiting", "Requests admitted without a first token yet.", m,
                             registry=r).labels(model_name)
        self._kv_usage = Gauge("pdserve:kv_cache_usage_perc", "KV-cache usage of a decode worker (1 = full).",
                               m + ["worker_id"], registry=r)
        self._healthy = Gauge("pdserve:worker_healthy", "1 when the worker answered its last stats poll.",
                              m + ["worker_id", "role"], registry=r)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def observe_batch(self, batch: TokenBatch) -> None:
        if batch.step_time_s > 0:
            self.decode_step.observe(batch.step_time_s)
        if batch.batch_size > 0:
            self.decode_batch_size.observe(batch.batch_size)
            if batch.bucket > 0:
                self.graph_padding_ratio.observe(max(0, batch.bucket - batch.batch_size) / batch.bucket)

    def observe_worker(self, stats: WorkerStats | None, worker_id: str, role: str, healthy: bool) -> None:
        self._healthy.labels(self.model_name, worker_id, role).set(1.0 if healthy else 0.0)
        if stats is not None and role == "decode" and stats.total_blocks > 0:
            self._kv_usage.labels(self.model_name, worker_id).set(1.0 - stats.free_blocks / stats.total_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
