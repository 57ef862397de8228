"""WorkerModel: what each rank of a worker holds to compute: its model (its shard under tensor
parallelism), its KV cache and the eager runner over them.

Built by the same code on every rank of a worker (prefill and decode workers' rank 0 and their
followers, the engine's), so their start-up collectives pair up: the KV pool is sized by the one rule
(cluster.kv.kv_cache.kv_pool_blocks) on each rank for its own KV heads, then the ranks take the smallest
count (block ids mean the same blocks on every rank: rank 0's allocator hands them out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.distributed.sharding import TPShard
from cluster.kv.kv_cache import KVCacheSpec, kv_numerics_tag, kv_pool_blocks, resolve_kv_cache_dtype
from cluster.model.config import ModelArchConfig
from cluster.model.llama import LlamaForCausalLM
from cluster.model.loader import load_model, resolve_dtype
from cluster.model.parallel_linear import TensorParallel
from cluster.engine.model_runner import ModelRunner
from cluster.worker.worker_config import WorkerConfig


def tensor_parallel(group, arch: ModelArchConfig) -> TensorParallel | None:
    """The model's view of a rank's group (None without one, or for a group of one)."""
    if group is None or group.size == 1:
        return None
    return TensorParallel(TPShard.of(arch, group.rank, group.size), group.comm)


@dataclass
class WorkerModel:
    arch: ModelArchConfig
    dtype: torch.dtype
    device: torch.device
    model: LlamaForCausalLM
    spec: KVCacheSpec
    runner: ModelRunner
    # What the K/V it holds depends on (cluster.kv.kv_cache.kv_numerics_tag: activation dtype, weight
    # quantization, cache dtype): prefill and decode workers compute it by this one rule, so both
    # salt their prefix caches alike and the KV transport's pair check compares like with like.
    kv_numerics: str
    group: object = None  # the TPGroup, or None

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @classmethod
    def load(cls, cfg: WorkerConfig, group=None, *, model: LlamaForCausalLM | None = None,
             arch: ModelArchConfig | None = None) -> "WorkerModel":
        """`model`: one already loaded (tests); else this rank's part of cfg.model_dir."""
        device = torch.device(cfg.device)
        arch = arch or (model.cfg if model is not None else ModelArchConfig.from_dir(cfg.model_dir))
        if model is None:
            model = load_model(cfg.model_dir, dtype=cfg.dtype, device=device, attention_backend=cfg.attention_backend,
                               quantization=cfg.quantization, tp=tensor_parallel(group, arch))
        # The activation dtype: the configured one, else the embedding's (the checkpoint's torch_dtype);
        # never the first parameter's in general, which FP8 weights keep in float8_e4m3fn.
        dtype = resolve_dtype(cfg.dtype) if cfg.dtype else model.embed_tokens.weight.dtype
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
        blocks = kv_pool_blocks(cfg, arch, dtype, device, kv_dtype=kv_dtype, num_kv_heads=model.num_kv_heads)
        if group is not None and group.size > 1:
            blocks = group.comm.min_int(blocks)
        spec = KVCacheSpec.for_model(arch, cfg.block_size, blocks, kv_dtype, model.num_kv_heads)
        return cls(arch, dtype, device, model, spec, ModelRunner(model, spec, device, group=group),
                   kv_numerics_tag(dtype, model.quant.tag, kv_dtype), group)


def _rank_device(cfg: WorkerConfig, rank: int) -> torch.device:
    """A rank's device: cfg.device, except that "cuda:i" (processes sharing a host's GPUs, tests and
    benchmarks) moves to "cuda:i+rank"; under Ray each rank sees only its own GPU ("cuda")."""
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and dev.index is not None:
        return torch.device("cuda", dev.index + rank)
    return dev


def lead_group(cfg: WorkerConfig, launch, **options):
    """Rank 0 of a worker with cfg.tensor_parallel_size > 1: starts the followers (`launch`, a
    cluster.distributed.rank_launcher.RankLauncher's launch) and forms the group; None for size 1.
    `options`: TPGroup.leader's (on_failure, timeouts)."""
    if cfg.tensor_parallel_size <= 1:
        return None
    from cluster.distributed.placement import where_am_i
    from cluster.distributed.tp_group import TPGroup

    arch = ModelArchConfig.from_dir(cfg.model_dir)
    TPShard.of(arch, 0, cfg.tensor_parallel_size)  # a model the group cannot split fails here, before any rank starts
    return TPGroup.leader(cfg.tensor_parallel_size, _rank_device(cfg, 0), resolve_dtype(cfg.dtype or arch.dtype),
                          launch, describe=where_am_i, **options)


def join_group(cfg: WorkerConfig, rank: int, rendezvous, **options):
    """A follower rank: joins rank 0's group (the device: _rank_device)."""
    from cluster.distributed.placement import where_am_i
    from cluster.distributed.tp_group import TPGroup

    arch = ModelArchConfig.from_dir(cfg.model_dir)
    return TPGroup.follower(rendezvous, rank, _rank_device(cfg, rank), resolve_dtype(cfg.dtype or arch.dtype),
                            describe=where_am_i, **options)


def rank_config(cfg: WorkerConfig, rank: int) -> WorkerConfig:
    """The WorkerConfig a rank builds its WorkerModel with (its own device)."""
    import dataclasses

    dev = _rank_device(cfg, rank)
    return cfg if str(dev) == cfg.device else dataclasses.replace(cfg, device=str(dev))
