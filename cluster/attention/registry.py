"""The attention backends by name: the one place where a name (WorkerConfig.attention_backend, the
CLI's --attention-backend) becomes a backend class.

Each entry imports its backend when it is first asked for, so a backend whose dependency is missing
(triton) fails only for the caller who named it. The backends import only the ABC (backend.py) and
never this module, so the registry depends on them and not the other way round: no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.attention.backend import AttentionBackend


def _torch() -> type[AttentionBackend]:
    from cluster.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend


def _triton() -> type[AttentionBackend]:
    from cluster.attention.triton_decode import TritonAttentionBackend

    return TritonAttentionBackend


# name -> its class, imported on first use. A backend's `name` attribute equals its key here.
BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {"torch": _torch, "triton": _triton}


def get_backend(name: str) -> type[AttentionBackend]:
    load = BACKENDS.get(name)
    if load is None:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    try:
        return load()
    except ImportError as e:  # e.g. triton missing: the caller asked for this backend explicitly
        raise ValueError(f"attention backend {name!r} is unavailable: {e}") from None
