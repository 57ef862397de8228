"""The paged KV cache's layout: one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim].

The cache's dtype is the model's activation dtype, or float8_e4m3fn with `--kv-cache-dtype fp8`
(`resolve_kv_cache_dtype`, the one place the name is read): one byte an element, so twice the blocks
per GB and half the bytes per transferred block. Each attention layer then stores K / k_scale and
V / v_scale (cluster.model.llama.Attention).

Under tensor parallelism each rank's cache holds only its KV heads (`num_kv_heads` = the model's
`num_kv_heads` attribute, cluster/distributed/sharding.py); block ids mean the same blocks on every rank
of a worker (one allocator, on rank 0, hands them out).

Block 0 is reserved (NULL_BLOCK): the allocator never hands it out, padded rows of a graph-replayed
batch point their block tables and slot mappings at it, so their writes land nowhere that matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cluster.kv.kv_blocks import NULL_BLOCK, blocks_for_tokens
from cluster.model.config import ModelArchConfig

if TYPE_CHECKING:
    from cluster.worker.worker_config import WorkerConfig

FP8_KV_DTYPE = torch.float8_e4m3fn


def resolve_kv_cache_dtype(name: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: "auto" (None) is the model's dtype; "fp8" / "fp8_e4m3" is e4m3 (vLLM's names)."""
    from cluster.errors import ModelLoadError
    from cluster.model.quantization import KV_CACHE_DTYPES

    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return model_dtype
    if name in KV_CACHE_DTYPES:
        return FP8_KV_DTYPE
    raise ModelLoadError(f"unsupported kv_cache_dtype {name!r}; supported: {KV_CACHE_DTYPES}")


def kv_numerics_tag(model_dtype: torch.dtype, quant_tag: str, kv_dtype: torch.dtype) -> str:
    """What the K/V a worker computes depends on, for the prefix-cache salt (cluster.kv.block_hash): the
    activation dtype, the weights' quantization (QuantConfig.tag) and the cache dtype. Workers that
    exchange KV must agree on it. Unquantized with a cache in the model's dtype: str(model_dtype), as
    before FP8 existed."""
    if quant_tag == "none" and kv_dtype == model_dtype:
        return str(model_dtype)
    return f"{model_dtype}|weights={quant_tag}|kv={kv_dtype}"


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int  # including the reserved NULL_BLOCK
    dtype: torch.dtype

    @classmethod
    def for_model(cls, cfg: ModelArchConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                  num_kv_heads: int | None = None) -> "KVCacheSpec":
        """num_kv_heads: this rank's (tensor parallelism); None: all of the model's."""
        return cls(cfg.num_layers, num_kv_heads or cfg.num_kv_heads, cfg.head_dim, block_size, num_blocks, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """All layers' K and V for one block: the unit a KV transfer moves."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def allocate(self, device: str | torch.device) -> torch.Tensor:
        # Zeroed so that a never-written slot can't hold NaN bit patterns that a masked lane
        # would still multiply (0 * NaN = NaN) in some kernels.
        return torch.zeros(self.shape, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes on the device
    free: int  # bytes free on the device right now (all processes)
    reserved_here: int  # bytes this process's allocator holds (weights loaded so far, caches)


def device_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, torch.cuda.memory_reserved(device))


def kv_pool_blocks(cfg: "WorkerConfig", arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                   memory: DeviceMemory | None = None, kv_dtype: torch.dtype | None = None,
                   num_kv_heads: int | None = None) -> int:
    """THE KV pool sizing rule, for prefill and decode workers alike (call it after the weights load).

    - `cfg.num_blocks` if set; on CPU `cfg.cpu_num_blocks`.
    - On CUDA: this worker's share of the device (`cfg.gpu_share`, < 1 when actors share a GPU) less
      what this process already holds (weights), less headroom for the largest step's activations,
      less the decode graph's features-variant state for max_num_seqs rows (cluster.sampling.sampler.
      features_state_bytes: allocated by a decode worker's graph runner after the pool), times
      `kv_memory_fraction`; never more than what is actually free. Counting the share from the
      total, not from free memory, keeps actors that start at the same time on one GPU from each
      taking the whole of it. With `cfg.gpu_memory_utilization` (vLLM's meaning: weights, activations
      and KV together take at most that fraction of the share) the KV gets that fraction of the share
      less the weights and the headroom, and kv_memory_fraction is not applied.
    `dtype` is the activations' (the headroom), `kv_dtype` the cache's (None: the same; FP8: one byte
    an element, twice the blocks), `num_kv_heads` this rank's under tensor parallelism (the ranks of a
    worker then take the smallest of their counts: cluster/distributed/shard_setup.py).
    Returns blocks including the reserved NULL_BLOCK."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if device.type != "cuda":
        return cfg.cpu_num_blocks
    mem = memory or device_memory(device)
    elem = torch.empty((), dtype=dtype).element_size()
    # Decode: the [B, V] logits dominate (the sampling kernel reads them in place, no [B, V]
    # temporaries; kept generous); prefill: the packed batch's gate/up and QKV activations (and their
    # temporaries). Hidden states are small beside them.
    decode_act = cfg.max_num_seqs * (arch.vocab_size * 4 * elem + 4 * arch.intermediate_size * elem)
    prefill_act = cfg.max_prefill_tokens * (6 * arch.intermediate_size + 8 * arch.hidden_size) * elem
    headroom = max(1 << 30, 2 * max(decode_act, prefill_act))
    from cluster.sampling.sampler import features_state_bytes  # here: kv_cache is imported by much that needs no sampler

    features = features_state_bytes(cfg.max_num_seqs, arch.vocab_size)
    share = mem.total * min(1.0, cfg.gpu_share)
    if cfg.gpu_memory_utilization is not None:
        mine = int(share * cfg.gpu_memory_utilization) - mem.reserved_here
        budget = min(mine - headroom, mem.free - headroom) - features
    else:
        mine = int(share) - mem.reserved_here
        budget = int((min(mine, mem.free) - headroom - features) * cfg.kv_memory_fraction)
    return max(2, blocks_that_fit(arch, cfg.block_size, kv_dtype or dtype, budget, num_kv_heads) + 1)


def blocks_that_fit(cfg: ModelArchConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                    num_kv_heads: int | None = None) -> int:
    """How many blocks a memory budget holds (e.g. a fraction of free GPU memory after weights)."""
    spec = KVCacheSpec.for_model(cfg, block_size, 1, dtype, num_kv_heads)
    return max(0, budget_bytes // spec.bytes_per_block)
