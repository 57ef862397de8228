"""The paged KV cache's layout: one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim].

Block 0 is reserved (NULL_BLOCK): the allocator never hands it out, padded rows of a graph-replayed
batch point their block tables and slot mappings at it, so their writes land nowhere that matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.model.config import ModelArchConfig

NULL_BLOCK = 0


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int  # including the reserved NULL_BLOCK
    dtype: torch.dtype

    @classmethod
    def for_model(cls, cfg: ModelArchConfig, block_size: int, num_blocks: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, num_blocks, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """All layers' K and V for one block: the unit a KV transfer moves."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, device: str | torch.device) -> torch.Tensor:
        # Zeroed so that a never-written slot can't hold NaN bit patterns that a masked lane
        # would still multiply (0 * NaN = NaN) in some kernels.
        return torch.zeros(self.shape, dtype=self.dtype, device=device)


def blocks_that_fit(cfg: ModelArchConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks a memory budget holds (e.g. a fraction of free GPU memory after weights)."""
    spec = KVCacheSpec.for_model(cfg, block_size, 1, dtype)
    return max(0, budget_bytes // spec.bytes_per_block)
