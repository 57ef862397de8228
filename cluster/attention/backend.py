"""The attention backend interface and its registry.

A backend stores the new tokens' K/V into the paged cache and attends over it. The model never sees
which backend runs: it calls `backend.forward(q, k, v, kv_layer, meta)` for every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from cluster.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new K/V into their slots. index_copy_ is capturable: no host sync, fixed shapes."""
        kvh, hd = k.shape[-2], k.shape[-1]
        kv_layer[0].view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
        kv_layer[1].view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def get_backend(name: str) -> type[AttentionBackend]:
    # Import the built-in backends lazily so that registering them has no import-order hazard.
    import cluster.attention.torch_ref  # noqa: F401

    if name == "triton":
        try:
            import cluster.attention.triton_decode  # noqa: F401
        except ImportError as e:  # triton missing: the caller asked for it explicitly
            raise ValueError(f"attention backend 'triton' is unavailable: {e}") from None
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]
