"""The grammar engine interface: a backend compiles a StructuredOutput for one tokenizer and makes
matchers; a matcher follows one request's tokens and says which tokens may come next, as a bitmask.

Backends (cluster.structured.xgrammar_backend; llguidance could be a second) implement these two
classes and are found by name through cluster.structured.registry; nothing else here imports them.

Bitmask layout (what the decode step's kernel reads, cluster.kernels.token_bitmask): int32 words,
W = ceil(vocab_size / 32) per row; token t is allowed iff bit (t & 31) of word (t >> 5) is set.
A backend's `fill_bitmasks` writes rows of such a [n, W] int32 CPU tensor (pinned or not).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from cluster.structured.structured_output import StructuredOutput


class GrammarMatcher(ABC):
    """One request's position in its grammar (host state, advanced token by token)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances over the token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, out: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into out[row] (see the module docstring)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer. `check` needs no tokenizer (a gateway may call it)."""

    name: str = ""

    @classmethod
    @abstractmethod
    def check(cls, so: StructuredOutput) -> None:
        """Raises InvalidRequestError if `so` cannot be compiled (bad schema, regex or grammar).
        Parses only: cheap next to `compile`."""

    @abstractmethod
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        """`vocab_size`: the model's (the logits' width, >= the tokenizer's); `stop_token_ids`: the
        tokens that end a sequence (the model's EOS), allowed once the grammar is complete."""

    @abstractmethod
    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar (opaque to callers; slow: run off the serving loops)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    # -- compiling in a child process (cluster.structured.compile_process) -------------------------
    # A backend that implements these four compiles in a child the compiler can kill at its
    # deadline; one that does not compiles on the compiler's threads (no hard deadline).
    def export(self) -> bytes | str | None:
        """What a child process needs to build this same backend (`from_export`); None: unsupported."""
        return None

    @classmethod
    def from_export(cls, data: bytes | str, vocab_size: int) -> "GrammarBackend":
        raise NotImplementedError

    def serialize(self, compiled: Any) -> bytes | str:
        raise NotImplementedError

    def deserialize(self, data: bytes | str) -> Any:
        raise NotImplementedError

    def nbytes(self, compiled: Any) -> int:
        """Host memory a compiled grammar holds (what the compiler's cache is bounded by)."""
        return 0

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], out: torch.Tensor, rows: Sequence[int]) -> None:
        """matchers[i]'s allowed tokens into out[rows[i]]; a backend may do them in parallel."""
        for m, r in zip(matchers, rows):
            m.fill_bitmask(out, r)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
