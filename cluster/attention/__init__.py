from cluster.attention.backend import AttentionBackend, get_backend, register_backend
from cluster.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "register_backend"]
