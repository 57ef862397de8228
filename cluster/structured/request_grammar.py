"""RequestGrammar: one request's grammar on one worker, from "compiling" to a matcher that follows its
tokens; and `fill_bitmasks`, how a batch of them writes its next-token masks.

Life: created at admission with the future of its compiled grammar (cluster.structured.
grammar_compiler) and the tokens the request already generated elsewhere (a migrated request's, or
the first token a prefill worker sampled, which can arrive before the compile is done). Tokens
accepted while compiling are kept; `ready()` (never blocks) builds the matcher once the grammar is
compiled and replays them. Callers schedule a constrained request only when it is ready: the
request waits for its grammar, the batch it would join does not. A compile still running after
`timeout_s` fails the request (the pool thread finishes it; a later request finds it cached).

A token the grammar refuses (it cannot happen when every token was sampled under the mask, but a
replay over tokens from elsewhere is checked) fails the request: `error` is set, the owner is told
(`on_fail`), and the request ends with an error instead of producing text outside its grammar.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

import torch

from cluster.structured.grammar import GrammarBackend, GrammarMatcher


class RequestGrammar:
    __slots__ = ("request_id", "_future", "_pending", "_on_fail", "_deadline", "backend", "matcher", "error")

    def __init__(self, request_id: str, compiled: Future, prior_tokens: Sequence[int] = (),
                 on_fail: Callable[["RequestGrammar"], None] | None = None, timeout_s: float = 60.0):
        self.request_id = request_id
        self._future = compiled  # -> (backend, compiled grammar)
        self._deadline = time.monotonic() + timeout_s
        self._pending: list[int] | None = list(prior_tokens)
        self._on_fail = on_fail
        self.backend: GrammarBackend | None = None
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None

    def ready(self) -> bool:
        """The matcher exists and has accepted every token so far (never blocks)."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if not self._future.done():
            if time.monotonic() > self._deadline:
                self._fail("the grammar took too long to compile")
            return False
        try:
            backend, compiled = self._future.result()
        except Exception as e:  # noqa: BLE001 - the compile failed after the admission check passed
            self._fail(f"the grammar failed to compile: {type(e).__name__}: {e}")
            return False
        m = backend.matcher(compiled)
        for t in self._pending:
            if not m.accept_token(t):
                self._fail(f"token {t}, generated earlier, is not allowed by the grammar")
                return False
        self._pending = None
        self.backend, self.matcher = backend, m
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until compiled, at most `timeout` (None: until the request's own compile deadline);
        returns ready(). The in-process engine and tests only: a serving loop never blocks on it."""
        if timeout is None:
            timeout = max(0.0, self._deadline - time.monotonic())
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            pass
        return self.ready()

    def accept(self, token_id: int) -> bool:
        """Advances over a sampled token (kept for the replay while compiling); False if refused."""
        if self.error is not None:
            return False
        if self.matcher is None:
            self._pending.append(token_id)
            return True
        if not self.matcher.accept_token(token_id):
            self._fail(f"token {token_id} is not allowed by the grammar")
            return False
        return True

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the request is complete."""
        return self.matcher is not None and self.matcher.is_terminated()

    def _fail(self, why: str) -> None:
        self.error = f"structured output: {why}"
        if self._on_fail is not None:
            self._on_fail(self)


def fill_bitmasks(grammars: Sequence[RequestGrammar], out: torch.Tensor, rows: Sequence[int]) -> None:
    """grammars[i]'s next-token mask into out[rows[i]] ([n, W] int32 CPU tensor). Every grammar must
    be ready. One backend call per backend (xgrammar fills them on several threads)."""
    if not grammars:
        return
    first = grammars[0].backend
    if all(g.backend is first for g in grammars):
        first.fill_bitmasks([g.matcher for g in grammars], out, rows)
        return
    groups: dict[int, tuple[GrammarBackend, list, list]] = {}
    for g, r in zip(grammars, rows):
        entry = groups.setdefault(id(g.backend), (g.backend, [], []))
        entry[1].append(g.matcher)
        entry[2].append(r)
    for backend, matchers, rs in groups.values():
        backend.fill_bitmasks(matchers, out, rs)
