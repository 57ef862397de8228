"""The attention backend interface (registry.py maps the backends' names to their classes).

A backend attends over the paged cache. The model never sees which backend runs: it calls
`backend.plan(meta)` once per forward pass, then `backend.forward(q, k, v, kv_layer, meta)` for every
layer, after the layer's rotary kernel has written the new tokens' K/V into their cache slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cluster.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = ""  # its key in registry.BACKENDS

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Per-pass preparation shared by all layers (e.g. a prefill kernel's work list); the default
        has none. Must not sync with the device when `meta` is a decode step (it runs under capture)."""
        return meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], possibly a strided view of the fused QKV
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], the new tokens' (already in kv_layer)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        k_scale: float = 1.0,  # an FP8 kv_layer holds K / k_scale and V / v_scale; else unused
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], contiguous
        ...
