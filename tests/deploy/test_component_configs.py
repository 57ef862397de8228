"""deploy.component_configs: every ClusterConfig setting reaches its component unchanged; GPU shares."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.worker.worker_config import WorkerConfig
from deploy.api_server import APIServerSpec
from deploy.component_configs import admission_limits, api_server_settings, gpus_per_actor, router_config, worker_config
from deploy.config import COMPONENT_DEFAULTS, ClusterConfig
from router.requests.admission import AdmissionLimits
from router.openai.gateway_config import GatewayConfig
from router.placement.pd_planner import PlannerConfig
from router.router_config import RouterConfig

# A valid value other than the default for every setting the mapping carries.
NOT_DEFAULT = dict(
    dtype="float16", attention_backend="triton", block_size=32, num_blocks=77, kv_memory_fraction=0.5,
    cpu_num_blocks=99, max_num_seqs=7, max_prefill_tokens=1000, local_prefill_chunk_tokens=33, max_model_len=999,
    enable_prefix_caching=False, graph_buckets=(1, 3), use_cuda_graph=False, prefill_graph_max_tokens=96,
    prefill_overlap="on", seed=5,
    gpu_memory_utilization=0.7,
    quantization="fp8", kv_cache_dtype="fp8", max_loop_restarts=9,
    prefill_placement="static", local_prefill_threshold=9, itl_cost_weight=3.5, stats_interval_s=0.7,
    call_timeout_s=11.0, prefill_timeout_s=12.0, reserve_wait_s=0.3, migration_wait_s=13.0,
    migrate_on_worker_death=False, prefill_policy="round_robin", decode_policy="round_robin",
    max_waiting_requests=17, queue_timeout_s=9.5, max_inflight_tokens=1234, retry_after_s=4,
    api_key="k", max_body_bytes=2048, token_timeout_s=14.0, tool_call_parser="hermes", enable_auto_tool_choice=True,
    planner_hysteresis=0.5, planner_confirmations=5, planner_min_dwell_s=15.0, planner_tpot_target_s=0.02,
)


def test_not_default_covers_every_carried_setting():
    assert set(NOT_DEFAULT) == set(COMPONENT_DEFAULTS)
    cfg = ClusterConfig(**NOT_DEFAULT)
    for name, value in NOT_DEFAULT.items():
        assert getattr(cfg, name) == value != ClusterConfig.model_fields[name].default, name


def test_every_setting_reaches_its_component():
    cfg = ClusterConfig(**NOT_DEFAULT, max_prefill_queue_s=2.5, worker_max_restarts=0)
    built = {
        WorkerConfig: worker_config(cfg, "/m", "cuda", gpu_share=0.5),
        RouterConfig: router_config(cfg),
        AdmissionLimits: admission_limits(cfg, 512),
        # The API servers' spec carries the gateway's settings to each process (deploy/api_server.py).
        GatewayConfig: APIServerSpec(index=0, listen_fd=3, parent_pid=1, **api_server_settings(
            cfg, router_address="ipc://r", model_dir="/m", served_model_name="m", max_model_len=512, sink_host="h",
            log_level="INFO")),
    }
    for name, (component, field) in COMPONENT_DEFAULTS.items():
        if component is PlannerConfig:
            continue  # deploy/planner_loop.py builds it (PlannerLoop.for_cluster)
        assert getattr(built[component], field) == getattr(cfg, name), name
    w, r, a = built[WorkerConfig], built[RouterConfig], built[AdmissionLimits]
    assert (w.model_dir, w.device, w.gpu_share) == ("/m", "cuda", 0.5)
    assert r.workers_restart is False and r.worker_max_restarts == 0
    assert router_config(ClusterConfig()).workers_restart is True and router_config(ClusterConfig()).worker_max_restarts == 3
    assert (a.max_model_len, a.block_size, a.max_prefill_queue_s) == (512, 32, 2.5)
    # vLLM's --enforce-eager: no graphs, whatever use_cuda_graph says
    assert worker_config(ClusterConfig(enforce_eager=True), "/m", "cuda").use_cuda_graph is False
    assert worker_config(ClusterConfig(), "/m", "cuda").use_cuda_graph is True
    # ... nor prefill graphs; otherwise the passes up to prefill_graph_max_tokens replay them
    assert worker_config(ClusterConfig(enforce_eager=True), "/m", "cuda").prefill_graph_max_tokens == 0
    assert worker_config(ClusterConfig(prefill_graph_max_tokens=128), "/m", "cuda").prefill_graph_max_tokens == 128
    assert worker_config(ClusterConfig(), "/m", "cuda").prefill_graph_max_tokens == 512
    with pytest.raises(ValueError):
        ClusterConfig(prefill_graph_max_tokens=-1)
    s = built[GatewayConfig]
    assert (s.router_address, s.served_model_name, s.max_model_len, s.sink_host, s.drain_timeout_s) == \
        ("ipc://r", "m", 512, "h", cfg.drain_timeout_s)


def test_worker_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        worker_config(ClusterConfig(), "/m", "cpu").seed = 1


def test_worker_config_and_gpu_shares():
    cfg = ClusterConfig(prefill_workers=1, decode_workers=1, num_blocks=64, max_num_seqs=8)
    w = worker_config(cfg, "/m", "cuda")
    assert (w.model_dir, w.device, w.num_blocks, w.max_num_seqs) == ("/m", "cuda", 64, 8)
    assert gpus_per_actor(cfg, 0) == 0.0
    assert gpus_per_actor(cfg, 1) == 0.5  # one prefill + one decode share the GPU
    assert gpus_per_actor(cfg, 2) == 1.0
    assert gpus_per_actor(ClusterConfig(prefill_workers=2, decode_workers=3), 2) == pytest.approx(1 / 3)
    assert gpus_per_actor(ClusterConfig(gpus_per_worker=0.25), 8) == 0.25
    assert gpus_per_actor(ClusterConfig(device="cpu"), 8) == 0.0


def test_tensor_parallel_workers_take_a_whole_gpu_per_rank():
    from cluster.errors import PdserveError

    cfg = ClusterConfig(prefill_workers=1, decode_workers=1, prefill_tp=2, decode_tp=2)
    assert worker_config(cfg, "/m", "cuda", role="prefill").tensor_parallel_size == 2
    assert worker_config(cfg, "/m", "cuda").tensor_parallel_size == 1  # the role-less base
    assert gpus_per_actor(cfg, 4) == 1.0  # 4 ranks, 4 GPUs
    assert gpus_per_actor(cfg, 0) == 0.0  # CPU: ranks are processes
    with pytest.raises(PdserveError, match="are 4 ranks, one GPU each; the Ray cluster has 3 GPUs"):
        gpus_per_actor(cfg, 3)
    with pytest.raises(PdserveError, match="each rank needs a whole GPU"):
        gpus_per_actor(ClusterConfig(decode_tp=2, gpus_per_worker=0.5), 8)
    mixed = ClusterConfig(prefill_workers=1, decode_workers=2, prefill_tp=2, decode_tp=1)
    assert gpus_per_actor(mixed, 4) == 1.0
