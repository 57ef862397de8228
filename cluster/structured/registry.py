"""Grammar backends by name. The registry imports a backend's module only when it is asked for (xgrammar
takes seconds to import), and backends never import the registry: they only implement
cluster.structured.grammar."""

from __future__ import annotations

from typing import Callable

from cluster.errors import InvalidRequestError
from cluster.structured.grammar import GrammarBackend

DEFAULT_BACKEND = "xgrammar"


def _xgrammar() -> type[GrammarBackend]:
    from cluster.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend


_LOADERS: dict[str, Callable[[], type[GrammarBackend]]] = {"xgrammar": _xgrammar}


def register_grammar_backend(name: str, loader: Callable[[], type[GrammarBackend]]) -> None:
    """Adds a backend: `loader()` imports it and returns its class."""
    _LOADERS[name] = loader


def grammar_backends() -> list[str]:
    return sorted(_LOADERS)


def get_grammar_backend(name: str = DEFAULT_BACKEND) -> type[GrammarBackend]:
    loader = _LOADERS.get(name)
    if loader is None:
        raise InvalidRequestError(f"unknown grammar backend {name!r} (one of {', '.join(grammar_backends())})",
                                  "structured_output")
    cls = loader()
    cls.name = name
    return cls
