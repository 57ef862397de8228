from cluster.attention.backend import AttentionBackend
from cluster.attention.metadata import AttentionMetadata
from cluster.attention.registry import BACKENDS, get_backend

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_backend"]
