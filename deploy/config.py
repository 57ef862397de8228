"""ClusterConfig: everything `pdserve serve` takes, from the command line or a YAML file.

Every field is both a YAML key (`decode_workers: 2`) and a flag (`--decode-workers 2`); the flags
are generated from the fields (deploy/config_flags.py), so the two can't drift apart. Flags override the YAML file, which
overrides the defaults. Each component gets its own frozen config built from it
(deploy/component_configs.py: WorkerConfig, RouterConfig, AdmissionLimits, the API servers' spec).

A setting a component has takes its default from that component's config (`_default`), so a default
lives in one place; where the deployment deliberately serves with another value than the component's
own default, the field says so (`DEPLOY_CHOICES`, checked by tests/cluster/test_single_source_rules.py).
The component configs import nothing heavy: `pdserve serve --help` loads neither Ray nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.errors import PdserveError
from cluster.worker.worker_config import WorkerConfig
from deploy.api_key import apply_key_sources, open_api_warnings, read_key_file
from deploy.bind_address import is_one_interface
from deploy.human_readable_int import human_readable_int
from router.requests.admission import AdmissionLimits
from router.openai.gateway_config import GatewayConfig
from router.placement.pd_planner import PlannerConfig
from router.router_config import RouterConfig


def _default(component: type, name: str) -> Any:
    """The default of the dataclass field `name` of a component's config."""
    field = {f.name: f for f in dataclasses.fields(component)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"{component.__name__}.{name} has no default")


# ClusterConfig field -> (component config, its field), for every setting ClusterConfig passes on
# unchanged and takes its default from.
COMPONENT_DEFAULTS: dict[str, tuple[type, str]] = {
    **{n: (WorkerConfig, n) for n in (
        "dtype", "attention_backend", "block_size", "num_blocks", "kv_memory_fraction", "cpu_num_blocks",
        "max_num_seqs", "max_prefill_tokens", "local_prefill_chunk_tokens", "max_model_len",
        "enable_prefix_caching", "graph_buckets", "use_cuda_graph", "prefill_graph_max_tokens", "prefill_overlap", "seed", "gpu_memory_utilization",
        "quantization", "kv_cache_dtype", "max_loop_restarts")},
    **{n: (RouterConfig, n) for n in (
        "prefill_placement", "local_prefill_threshold", "itl_cost_weight", "stats_interval_s", "call_timeout_s",
        "prefill_timeout_s", "reserve_wait_s", "migration_wait_s", "migrate_on_worker_death", "prefill_policy",
        "decode_policy")},
    **{n: (AdmissionLimits, n) for n in ("max_waiting_requests", "queue_timeout_s", "max_inflight_tokens",
                                         "retry_after_s")},
    **{n: (GatewayConfig, n) for n in ("api_key", "max_body_bytes", "token_timeout_s", "tool_call_parser",
                                        "enable_auto_tool_choice")},
    "planner_hysteresis": (PlannerConfig, "hysteresis"),
    "planner_confirmations": (PlannerConfig, "confirmations"),
    "planner_min_dwell_s": (PlannerConfig, "min_dwell_s"),
    "planner_tpot_target_s": (PlannerConfig, "tpot_target_s"),
}

# Where the deployment serves with another value than the component's own default, on purpose:
# ClusterConfig field -> (component config, its field, why).
DEPLOY_CHOICES: dict[str, tuple[type, str, str]] = {
    "max_prefill_queue_s": (AdmissionLimits, "max_prefill_queue_s", "the component has no limit (inf) unless "
                            "given one; a served cluster answers 429 past 5 s of prefill queue"),
    "planner_min_prefill_workers": (PlannerConfig, "min_prefill", "the planner may remove every prefill worker; "
                                    "the launcher keeps one (the KV transport group is formed at start)"),
    "worker_max_restarts": (RouterConfig, "worker_max_restarts", "Ray restarts dead workers in a served cluster "
                            "(3 times); the router alone does not assume it"),
    "device": (WorkerConfig, "device", "'auto' is resolved per actor (cuda when it holds a GPU); a worker is "
               "given the resolved device"),
    "tensor_parallel_size": (WorkerConfig, "tensor_parallel_size", "an alias that sets prefill_tp and decode_tp "
                             "(None: each role's own, whose default is the component's)"),
}


def _d(name: str) -> Any:
    """ClusterConfig's default for `name`: the component's (COMPONENT_DEFAULTS)."""
    return _default(*COMPONENT_DEFAULTS[name])


def ray_address_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The Ray to join that the environment names: RAY_ADDRESS, Ray's own variable, as `ray.init()` and
    `ray job submit` read it (empty: unset)."""
    return (os.environ if env is None else env).get("RAY_ADDRESS") or None


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    # -- what to serve, where ---------------------------------------------------------------------
    model: str | None = None
    """Hugging Face model directory, a GGUF file, or a hub id (org/name) found in the local Hugging Face
    cache (never downloaded); none serves the built-in demo model."""
    served_model_name: str | None = None
    """Model name clients pass as `model` and the metrics' model_name label (default: the model
    directory's name, or `pdserve-demo`; for a hub id, the id as given)."""
    host: str = "127.0.0.1"
    """Interface the HTTP gateway listens on (0.0.0.0 for all)."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port (0: any free port)."""
    api_key: str | None = Field(_d("api_key"), repr=False)
    """If set, /v1, /tokenize, /detokenize, /stats and /metrics require `Authorization: Bearer <key>`.
    Prefer api_key_file or the PDSERVE_API_KEY environment variable: a flag is visible in `ps`."""
    api_key_file: str | None = None
    """File whose first line is the API key (keeps the key out of the process list and the YAML file)."""
    api_servers: int | None = Field(None, ge=1, le=64)
    """HTTP API-server processes sharing the port, each with its own token stream (none: a quarter of
    the cores, 1 to 4; see deploy.api_server.default_api_servers)."""
    address: str | None = None
    """Ray cluster to join from one of its nodes ('auto' or 'host:6379'); none: the RAY_ADDRESS
    environment variable's (as `ray.init` reads it), else a local Ray instance is started.
    (Ray Client 'ray://' addresses are not supported: workers push tokens to this process directly.)"""

    # -- workers and their resources ----------------------------------------------------------------
    prefill_workers: int = Field(1, ge=0, le=1024)
    """Prefill actors (0: every prompt is prefilled on its decode worker)."""
    decode_workers: int = Field(1, ge=1, le=1024)
    """Decode actors."""
    prefill_tp: int = Field(_default(WorkerConfig, "tensor_parallel_size"), ge=1, le=64)
    """Tensor-parallel ranks of each prefill worker: one process and one GPU each, on one node; the
    router sees one worker (its rank 0). The model's attention heads must split evenly (KV heads are
    replicated when fewer than the ranks)."""
    decode_tp: int = Field(_default(WorkerConfig, "tensor_parallel_size"), ge=1, le=64)
    """Tensor-parallel ranks of each decode worker (see prefill_tp); the KV moves between prefill and
    decode workers of different sizes by KV head."""
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    """Sets prefill_tp and decode_tp at once (vLLM's --tensor-parallel-size); a role's own setting may
    only repeat it."""
    gpus_per_worker: float | None = Field(None, ge=0.0, le=8.0)
    """GPUs per actor; none: 1 when there are enough GPUs, an equal share when actors must share GPUs, 0 without."""
    cpus_per_worker: float = Field(1.0, ge=0.0)
    """CPUs Ray reserves per actor."""
    prefill_resources: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources every prefill actor needs, e.g. {"prefill": 1} to pin prefill to the nodes
    started with --resources '{"prefill": N}' (JSON on the command line)."""
    decode_resources: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources every decode actor needs, e.g. {"decode": 1} (JSON on the command line)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device the workers run on ('auto': cuda when the actor has a GPU)."""
    ready_timeout_s: float = Field(600.0, gt=0)
    """How long workers may take to load the model and answer their first stats call."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long the launcher waits for Ray to place the workers' resources that exist but are held by
    others (resources the cluster does not have at all are an error at once)."""

    # -- the engine inside each worker (WorkerConfig) -----------------------------------------------
    dtype: Literal["auto", "float32", "float", "float16", "half", "bfloat16"] | None = _d("dtype")
    """Activation (and KV) dtype: 'auto' (or none) is the checkpoint's torch_dtype; 'half' and 'float'
    are float16 and float32 (vLLM's names). FP8 weights keep theirs."""
    quantization: Literal["fp8"] | None = _d("quantization")
    """'fp8': quantize the checkpoint's linear weights to FP8 e4m3 at load (per output channel; W8A8 with
    dynamic per-token activation scales where that is faster). None: as the checkpoint is stored (an FP8
    checkpoint, compressed-tensors or HF fp8, loads as FP8 by itself)."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = _d("kv_cache_dtype")
    """KV cache dtype: 'auto' is the activation dtype; 'fp8' / 'fp8_e4m3' an e4m3 cache (one byte an
    element: twice the blocks, half the bytes per KV transfer). Prefill and decode workers must agree."""
    attention_backend: str = _d("attention_backend")
    """Attention backend registered in cluster.attention."""
    block_size: int = Field(_d("block_size"), ge=1, le=1024)
    """Tokens per KV block (a power of two)."""
    num_blocks: int | None = Field(_d("num_blocks"), ge=2)
    """KV blocks per worker; none: sized from kv_memory_fraction on GPU, cpu_num_blocks on CPU."""
    kv_memory_fraction: float = Field(_d("kv_memory_fraction"), gt=0.0, le=1.0)
    """Fraction of the GPU memory left after the weights that the KV cache takes (when
    gpu_memory_utilization is not set)."""
    gpu_memory_utilization: float | None = Field(_d("gpu_memory_utilization"), gt=0.0, le=1.0)
    """vLLM's: the fraction of a worker's GPU (of its share, when workers share one) that weights, activations and KV
    cache take together; the KV cache gets what is left of it. None: size the KV cache by kv_memory_fraction."""
    cpu_num_blocks: int = Field(_d("cpu_num_blocks"), ge=2)
    """KV blocks per worker on CPU."""
    max_num_seqs: int = Field(_d("max_num_seqs"), ge=1)
    """Most sequences a decode worker runs at once."""
    max_prefill_tokens: int = Field(_d("max_prefill_tokens"), ge=1)
    """Token budget of one prefill step."""
    local_prefill_chunk_tokens: int = Field(_d("local_prefill_chunk_tokens"), ge=1)
    """Most prompt tokens a decode worker prefills locally between two decode steps while requests are decoding on it
    (the rest of a long prompt goes in later chunks, each followed by a decode step). 256 tokens of the 8B shape take
    ~5.7 ms on an H200 (42-46k prompt tokens/s measured, loadtest/results/prefill_h200.md), as long as its decode step
    at batch 64 (5.82 ms, decode_h200.md): a running request's token gap at most doubles while a long prompt goes in."""
    warmup: bool = True
    """Warm every worker up before /ready: each prefill shape class (twice; the second run seeds the
    measured rates), the decode worker's local-prefill path and a decode step of every graph variant."""
    max_model_len: int | None = Field(_d("max_model_len"), ge=2)
    """Context length (default: the model's max_position_embeddings). Takes vLLM's suffixes: 8k = 8000,
    8K = 8192, 1m = 1000000, 1M = 1048576, 25.6k = 25600."""
    enable_prefix_caching: bool = _d("enable_prefix_caching")
    """Keep freed full KV blocks findable by their content on every worker, so a prompt's cached prefix
    is neither recomputed nor sent again (vLLM's automatic prefix caching)."""
    graph_buckets: str | tuple[int, ...] = _d("graph_buckets")
    """Decode batch sizes captured as CUDA graphs: 'vllm', 'pow2' or a list like 1,2,4,8."""
    use_cuda_graph: bool = _d("use_cuda_graph")
    """Replay decode steps as CUDA graphs (GPU only)."""
    prefill_graph_max_tokens: int = Field(_d("prefill_graph_max_tokens"), ge=0)
    """Prefill passes up to this many tokens replay CUDA graphs (GPU, triton, TP 1); 0: all eager."""
    prefill_overlap: Literal["auto", "on", "off"] = _d("prefill_overlap")
    """Prefill worker: launch a short (graph-replayed) pass while the pass ahead of it is still on the GPU,
    before that one's first tokens are read, so a prompt arriving just after a pass began does not wait
    for it to finish on the host. 'auto': on CUDA only. Off by default until a GPU run measures it."""
    enforce_eager: bool = False
    """vLLM's: no CUDA graphs, decode or prefill (--no-use-cuda-graph --prefill-graph-max-tokens 0)."""
    chat_template: str | None = None
    """The chat template /v1/chat/completions renders messages with, instead of the tokenizer's: a file's
    path, or the Jinja template itself (vLLM's --chat-template). Checked before anything starts."""
    generation_config: str = "auto"
    """Default sampling parameters, as vLLM: 'auto' takes temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (the default max_tokens) from the model's
    generation_config.json, each used where a request does not set it; 'vllm' ignores the file; a
    folder: its generation_config.json."""
    seed: int = Field(_d("seed"), ge=0)
    """Seed of the workers' engines."""
    max_loop_restarts: int = Field(_d("max_loop_restarts"), ge=0)
    """A decode worker whose loop raised more often than this (each time its requests move to
    another worker and the loop starts again) stays down and reports itself unhealthy."""

    # -- router: admission and placement -------------------------------------------------------------
    prefill_placement: Literal["adaptive", "static"] = _d("prefill_placement")
    """Where prompts are prefilled. 'adaptive': on the chosen decode worker when that is cheaper than the
    prefill pool (its queue over its measured rate, the prompt's own prefill and KV transfer) counting
    the stall it adds to the requests decoding there; else on a prefill worker. 'static': on the decode
    worker only at or below local_prefill_threshold tokens."""
    local_prefill_threshold: int = Field(_d("local_prefill_threshold"), ge=0)
    """Prompts of at most this many tokens are always prefilled on their decode worker (both modes; 0: none
    by length alone)."""
    itl_cost_weight: float = Field(_d("itl_cost_weight"), ge=0.0)
    """Adaptive placement: how many seconds of TTFT one second added to the running requests' time per
    output token is worth (20 = the ratio of the usual SLOs, 1 s TTFT to 50 ms TPOT)."""
    max_prefill_queue_s: float = Field(5.0, gt=0.0)
    """A request gets 429 when every prefill path (each prefill worker, each decode worker's local queue)
    would make it wait longer than this before its prefill starts (queued tokens over measured rates)."""
    prefill_policy: str = _d("prefill_policy")
    """Prefill placement policy (router.placement.placement.PREFILL_POLICIES)."""
    decode_policy: str = _d("decode_policy")
    """Decode placement policy (router.placement.placement.DECODE_POLICIES)."""
    max_waiting_requests: int = Field(_d("max_waiting_requests"), ge=1)
    """Requests the admission queue holds while they wait for KV and prefill capacity (FCFS per API
    server, round robin between them); beyond it, HTTP 429 with Retry-After."""
    queue_timeout_s: float = Field(_d("queue_timeout_s"), gt=0.0)
    """Longest wait in the admission queue: a request that has waited this long, or would (its place
    over the measured rate of admissions), gets HTTP 429 with Retry-After."""
    max_inflight_tokens: int = Field(_d("max_inflight_tokens"), ge=1)
    """Sum of prompt + max_tokens over unfinished requests; beyond it, a request waits in the queue."""
    retry_after_s: int = Field(_d("retry_after_s"), ge=0)
    """Retry-After sent with a 429."""
    reserve_wait_s: float = Field(_d("reserve_wait_s"), ge=0.0)
    """How long a request waits for a decode worker with room before a 429."""
    migration_wait_s: float = Field(_d("migration_wait_s"), ge=0.0)
    """How long a request moved off a dead worker may wait for a decode worker with room (the dead
    worker's transfers may hold blocks a moment more) before it ends with an error event."""
    worker_max_restarts: int = Field(3, ge=-1)
    """How many times Ray restarts a prefill or decode worker's actor that died (-1: always; 0: a dead
    worker stays out). A restarted worker rejoins the KV transport, warms up and is placed on again;
    migrated requests wait for it (up to migration_wait_s) while no decode worker is healthy."""
    migrate_on_worker_death: bool = _d("migrate_on_worker_death")
    """A dead worker's requests are placed again elsewhere (prompt + tokens so far; the stream goes on);
    off: they end with an error event."""
    stats_interval_s: float = Field(_d("stats_interval_s"), gt=0.0)
    """How often the router polls a busy worker's stats (an idle one: every second,
    router.workers.worker_health.IDLE_POLL_S, or at this interval if it is longer)."""
    prefill_dispatch: Literal["zmq", "ray"] = "zmq"
    """How a prompt reaches its prefill worker. 'zmq': a signed frame to its dispatch socket and its answer
    as a frame back to the router (cluster/wire/prefill_dispatch.py; one Ray call per worker watches it
    live); 'ray': a Ray actor call per prompt, a round trip more."""
    call_timeout_s: float = Field(_d("call_timeout_s"), gt=0.0)
    """Timeout of the router's control calls to workers (reserve, stats, abort)."""
    prefill_timeout_s: float = Field(_d("prefill_timeout_s"), gt=0.0)
    """Timeout of one prefill (queue + compute + KV transfer)."""
    token_timeout_s: float = Field(_d("token_timeout_s"), gt=0.0)
    """A request that gets no token for this long fails."""
    drain_timeout_s: float = Field(30.0, ge=0.0)
    """On SIGTERM: new requests get 503 and /ready turns false at once; in-flight requests may finish
    for up to this long, then the server stops (a second SIGTERM stops it at once)."""
    max_body_bytes: int = Field(_d("max_body_bytes"), ge=1024)
    """Largest accepted HTTP request body."""
    tool_call_parser: str | None = _d("tool_call_parser")
    """How the model writes tool calls (vLLM's names: llama3_json, hermes, mistral): chat replies are
    parsed into `tool_calls`, and tool_choice "required" or a named function makes the model write a
    valid call in that format. None: requests may render tools with tool_choice "none" only."""
    enable_auto_tool_choice: bool = _d("enable_auto_tool_choice")
    """Serve tool_choice "auto" (the default with tools): the model decides whether to call (needs
    tool_call_parser, as vLLM's flag)."""
    token_stream_host: str | None = None
    """Address the decode workers push to: every API server's token sink and the router's step-record
    sink bind it (default: 127.0.0.1 locally, this node's IP in a cluster)."""
    kv_store_port: int = Field(0, ge=0, le=65535)
    """Port of the KV rendezvous store, on the driver's internal address (0: any free port; fix it for a firewall)."""
    kv_store_memory_limit_mib: int = Field(1024, ge=64, le=1 << 20)
    """Memory cap of the KV store's process in MiB, beyond its ~300 at start: a fill past it fails there."""
    kv_store_sweep_s: float = Field(1.0, gt=0, le=60)
    """Seconds between sweeps of the KV store's warden, which deletes what no holder of the secret wrote."""
    kv_transport: Literal["torch_dist", "same_gpu", "local"] | None = None
    """KV transport kind (cluster.transport.factory); none: same_gpu when actors share one GPU, else torch_dist."""

    # -- the P:D planner -------------------------------------------------------------------------------
    planner: bool = False
    """Move workers between prefill and decode while serving (router.placement.pd_planner), one at a time: drain
    the worker, then start the other role's actor on its GPU. Needs prefill_workers >= 1."""
    planner_interval_s: float = Field(10.0, gt=0.0)
    """How often the planner looks at the measured rates and the request mix."""
    planner_window_s: float = Field(60.0, gt=0.0)
    """The request mix (arrival rate, prompt and output lengths) is measured over this window."""
    planner_min_dwell_s: float = Field(_d("planner_min_dwell_s"), ge=0.0)
    """Least time between two role switches."""
    planner_hysteresis: float = Field(_d("planner_hysteresis"), ge=0.0, lt=1.0)
    """Switch only when the better split lowers the bottleneck utilisation by this fraction."""
    planner_confirmations: int = Field(_d("planner_confirmations"), ge=1)
    """Consecutive evaluations that must agree before a switch."""
    planner_min_prefill_workers: int = Field(1, ge=0)
    """The planner keeps at least this many prefill workers (adaptive placement already prefills on
    decode workers when the prefill pool is the slower path)."""
    planner_tpot_target_s: float = Field(_d("planner_tpot_target_s"), gt=0.0)
    """Decode capacity is counted at the batch whose measured step time meets this."""
    planner_drain_timeout_s: float = Field(60.0, ge=0.0)
    """How long a worker being switched may finish what it holds; what is left then migrates."""

    @model_validator(mode="before")
    @classmethod
    def _tensor_parallel_alias(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("tensor_parallel_size") is None:
            return data
        tp = data["tensor_parallel_size"]
        data = dict(data)
        for role in ("prefill_tp", "decode_tp"):
            if data.get(role) is not None and data[role] != tp:
                raise ValueError(f"tensor_parallel_size {tp} conflicts with {role} {data[role]}; give one of them")
            data[role] = tp
        return data

    @field_validator("prefill_resources", "decode_resources", mode="before")
    @classmethod
    def _resources(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON object of resource amounts: {e}") from None
        if isinstance(v, dict):
            reserved = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(v))
            if reserved:
                raise ValueError(f"{reserved} are set by cpus_per_worker/gpus_per_worker, not as custom resources")
            if any(not isinstance(x, (int, float)) or x < 0 for x in v.values()):
                raise ValueError("resource amounts must be non-negative numbers")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        return {"auto": None, "half": "float16", "float": "float32"}.get(v, v) if v is not None else None

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _human_int(cls, v: Any) -> Any:
        return human_readable_int(v) if isinstance(v, str) else v

    @field_validator("block_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    @field_validator("graph_buckets", mode="before")
    @classmethod
    def _buckets(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("vllm", "pow2"):
            try:
                v = tuple(int(x) for x in v.split(",") if x.strip())
            except ValueError:
                raise ValueError("graph_buckets must be 'vllm', 'pow2' or comma-separated sizes") from None
        if isinstance(v, (list, tuple)):
            if not v or any((not isinstance(x, int)) or x < 1 for x in v):
                raise ValueError("graph bucket sizes must be positive integers")
            return tuple(sorted(set(v)))
        return v

    @field_validator("token_stream_host")
    @classmethod
    def _internal_host(cls, v: str | None) -> str | None:
        # The token stream (and the KV rendezvous store, on the same address) take unauthenticated
        # messages: they listen on one internal address, never on every interface.
        if v is not None and not is_one_interface(v):  # an allow-list: deploy/bind_address.py
            raise ValueError(f"token_stream_host must be the cluster's internal address (an IP address or a host "
                             f"name of one interface), not {v!r}")
        return v

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("api_key must not be empty")
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_call_parser(cls, v: str | None) -> str | None:
        if v is not None:
            from router.openai.tool_parsers import get_tool_parser  # lazy: see _prefill_policy

            get_tool_parser(v)  # ValueError naming the choices
        return v

    @field_validator("prefill_policy")
    @classmethod
    def _prefill_policy(cls, v: str) -> str:
        # Lazy: the policies' module imports torch (through cluster.wire.messages); `serve --help` reads
        # this class without validating anything.
        from router.placement.placement import PREFILL_POLICIES

        if v not in PREFILL_POLICIES.names():
            raise ValueError(f"unknown prefill policy {v!r}; choose from {PREFILL_POLICIES.names()}")
        return v

    @field_validator("decode_policy")
    @classmethod
    def _decode_policy(cls, v: str) -> str:
        from router.placement.placement import DECODE_POLICIES  # lazy: see _prefill_policy

        if v not in DECODE_POLICIES.names():
            raise ValueError(f"unknown decode policy {v!r}; choose from {DECODE_POLICIES.names()}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _key_from_file(cls, data: Any) -> Any:
        return read_key_file(data)

    def security_warnings(self) -> list[str]:
        return open_api_warnings(self.host, self.api_key)

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterConfig":
        if self.max_prefill_tokens < self.block_size:
            raise ValueError("max_prefill_tokens must be at least block_size")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (how the model writes its calls)")
        if self.planner:
            if self.prefill_workers < 1:
                raise ValueError("the planner needs prefill_workers >= 1 (the KV transport group is formed at start)")
            if self.prefill_resources != self.decode_resources:
                raise ValueError("the planner moves workers between roles on the same bundle: prefill_resources "
                                 "and decode_resources must be equal")
            if self.prefill_tp != self.decode_tp:
                raise ValueError("the planner moves workers between roles on the same bundle: prefill_tp and "
                                 "decode_tp must be equal")
        if self.kv_transport == "same_gpu" and max(self.prefill_tp, self.decode_tp) > 1:
            raise ValueError("the same_gpu KV transport shares one GPU between one prefill and one decode process; "
                             "tensor-parallel workers move KV over torch_dist")
        return self

    def tp_of(self, role: str) -> int:
        """The tensor-parallel size of a role's workers."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def load(cls, yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None,
             env: dict[str, str] | None = None) -> "ClusterConfig":
        """Defaults < YAML file < environment (PDSERVE_API_KEY, RAY_ADDRESS) < explicit overrides (the flags)."""
        data: dict[str, Any] = {}
        if yaml_path is not None:
            data.update(read_yaml(yaml_path))
        env = os.environ if env is None else env
        apply_key_sources(data, overrides or {}, env)  # the key is one setting (deploy/api_key.py)
        if (ray_address := ray_address_from_env(env)) is not None:
            data["address"] = ray_address
        data.update(overrides or {})
        try:
            return cls(**data)
        except ValidationError as e:
            raise PdserveError(_one_line(e)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise PdserveError(f"config file {p} does not exist") from None
    except yaml.YAMLError as e:
        raise PdserveError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PdserveError(f"config file {p} must hold a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _one_line(e: ValidationError) -> str:
    parts = [f"{'.'.join(str(x) for x in err['loc']) or 'config'}: {err['msg']}" for err in e.errors()]
    return "invalid configuration: " + "; ".join(parts)
