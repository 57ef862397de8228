"""From one ClusterConfig to each component's own config: what the workers, the router, its admission
and the API-server processes are built with, and the share of a GPU each worker actor gets.

The defaults run the other way: ClusterConfig takes each component's default from that component's
config (deploy/config.py), so the mapping here only carries values, never decides one
(tests/cluster/test_single_source_rules.py builds every component from a default ClusterConfig and
compares it with the component's own defaults).
"""

from __future__ import annotations

import math
from typing import Any

from cluster.errors import PdserveError
from cluster.worker.worker_config import WorkerConfig
from deploy.config import ClusterConfig
from router.requests.admission import AdmissionLimits
from router.router_config import RouterConfig


def worker_config(cfg: ClusterConfig, model_dir: str, device: str, gpu_share: float = 1.0,
                  role: str | None = None, cluster_secret: bytes = b"") -> WorkerConfig:
    """What every worker actor of `role` is started with (None: a role-independent base, TP 1).
    gpu_share: the fraction of one GPU each actor is given (< 1 when actors share a GPU).
    cluster_secret: the launcher's (cluster/wire/frame_auth.py)."""
    return WorkerConfig(
        model_dir=model_dir, dtype=cfg.dtype, device=device, attention_backend=cfg.attention_backend,
        block_size=cfg.block_size, num_blocks=cfg.num_blocks, kv_memory_fraction=cfg.kv_memory_fraction,
        gpu_share=gpu_share,
        cpu_num_blocks=cfg.cpu_num_blocks, max_num_seqs=cfg.max_num_seqs,
        max_prefill_tokens=cfg.max_prefill_tokens, local_prefill_chunk_tokens=cfg.local_prefill_chunk_tokens,
        max_model_len=cfg.max_model_len, enable_prefix_caching=cfg.enable_prefix_caching,
        graph_buckets=cfg.graph_buckets, use_cuda_graph=cfg.use_cuda_graph and not cfg.enforce_eager,
        prefill_graph_max_tokens=0 if cfg.enforce_eager else cfg.prefill_graph_max_tokens,
        prefill_overlap=cfg.prefill_overlap,
        seed=cfg.seed, tensor_parallel_size=1 if role is None else cfg.tp_of(role),
        gpu_memory_utilization=cfg.gpu_memory_utilization, quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype, max_loop_restarts=cfg.max_loop_restarts, cluster_secret=cluster_secret,
    )


def router_config(cfg: ClusterConfig) -> RouterConfig:
    return RouterConfig(
        prefill_placement=cfg.prefill_placement, itl_cost_weight=cfg.itl_cost_weight,
        local_prefill_threshold=cfg.local_prefill_threshold, stats_interval_s=cfg.stats_interval_s,
        call_timeout_s=cfg.call_timeout_s, prefill_timeout_s=cfg.prefill_timeout_s,
        reserve_wait_s=cfg.reserve_wait_s, migration_wait_s=cfg.migration_wait_s,
        migrate_on_worker_death=cfg.migrate_on_worker_death, worker_max_restarts=cfg.worker_max_restarts,
        prefill_policy=cfg.prefill_policy,
        decode_policy=cfg.decode_policy,
    )


def admission_limits(cfg: ClusterConfig, max_model_len: int) -> AdmissionLimits:
    """max_model_len: the served one (cluster.kv.request_limits.served_max_model_len of the model)."""
    return AdmissionLimits(
        max_model_len=max_model_len, block_size=cfg.block_size, max_waiting_requests=cfg.max_waiting_requests,
        queue_timeout_s=cfg.queue_timeout_s, max_inflight_tokens=cfg.max_inflight_tokens,
        retry_after_s=cfg.retry_after_s, max_prefill_queue_s=cfg.max_prefill_queue_s)


def api_server_settings(cfg: ClusterConfig, *, router_address: str, model_dir: str, served_model_name: str,
                        max_model_len: int, sink_host: str, log_level: str, chat_template: str | None = None,
                        sampling_defaults: dict | None = None, cluster_secret: bytes = b"",
                        precision: dict[str, str] | None = None) -> dict[str, Any]:
    """The fields of deploy.api_server.APIServerSpec that every API-server process shares (each adds
    its index, the listening socket's descriptor and the launcher's pid). chat_template: the template's
    text (deploy.preflight read it); sampling_defaults: cluster.sampling.generation_defaults.SamplingDefaults as a dict;
    precision: the served dtype, quantization and KV cache dtype (deploy.preflight.ServedModel.precision)."""
    return dict(router_address=router_address, model_dir=model_dir, served_model_name=served_model_name,
                max_model_len=max_model_len, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                token_timeout_s=cfg.token_timeout_s, drain_timeout_s=cfg.drain_timeout_s, sink_host=sink_host,
                tool_call_parser=cfg.tool_call_parser, enable_auto_tool_choice=cfg.enable_auto_tool_choice,
                log_level=log_level, chat_template=chat_template, sampling_defaults=sampling_defaults or {},
                cluster_secret=cluster_secret, **(precision or {}))


def cache_config_info(cfg: ClusterConfig) -> dict[str, Any]:
    """The KV cache settings vllm:cache_config_info reports (router.stats.metrics.RouterMetrics), as vLLM names them."""
    return {"block_size": cfg.block_size, "cache_dtype": cfg.kv_cache_dtype,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "gpu_memory_utilization": cfg.gpu_memory_utilization if cfg.gpu_memory_utilization is not None else "",
            "quantization": cfg.quantization or ""}


def gpus_per_actor(cfg: ClusterConfig, cluster_gpus: float) -> float:
    """1 GPU each when there are enough; an equal share (1/k of one GPU) when actors must share. An
    actor is one rank of a worker: a tensor-parallel worker of N ranks is N actors, which never share a
    GPU (NCCL puts one rank of a group on a device), so they need a GPU each (PdserveError otherwise)."""
    tp = max(cfg.prefill_tp, cfg.decode_tp)
    if cfg.gpus_per_worker is not None:
        if tp > 1 and 0 < cfg.gpus_per_worker < 1:
            raise PdserveError(f"gpus_per_worker {cfg.gpus_per_worker} shares GPUs between tensor-parallel ranks; "
                               "each rank needs a whole GPU")
        return cfg.gpus_per_worker
    if cfg.device == "cpu" or cluster_gpus < 1:
        return 0.0
    n = cfg.prefill_workers * cfg.prefill_tp + cfg.decode_workers * cfg.decode_tp
    if cluster_gpus >= n:
        return 1.0
    if tp > 1:
        raise PdserveError(f"{cfg.prefill_workers} prefill x TP {cfg.prefill_tp} + {cfg.decode_workers} decode x TP "
                           f"{cfg.decode_tp} workers are {n} ranks, one GPU each; the Ray cluster has "
                           f"{cluster_gpus:g} GPUs")
    return 1.0 / math.ceil(n / int(cluster_gpus))
