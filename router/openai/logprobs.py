"""Logprobs in OpenAI's two response shapes, from what the decode worker sends (already with token
strings: cluster.wire.stream_messages.PositionLogprobs). Nothing here tokenizes.

- /v1/completions (`logprobs: N`): {tokens, token_logprobs, top_logprobs, text_offset}; each position's
  top_logprobs maps the N most likely tokens' strings and the sampled token's to their logprobs (as
  OpenAI and vLLM: up to N + 1 entries; N = 0 gives the sampled token's alone). text_offset: the
  character offset of each token's string in the concatenation of all of them (vLLM's convention).
- /v1/chat/completions (`logprobs: true, top_logprobs: N`): {content: [{token, logprob, bytes,
  top_logprobs: [N entries]}]}, bytes the UTF-8 of the token's string.

With echo, a completion's logprobs start with the prompt's: its first token has none (nothing
precedes it), so it comes as a `PromptStart` and is written with null logprob and top_logprobs.

vLLM's `prompt_logprobs: k` (both endpoints): per prompt token (the first: null) a map of token id to
{logprob, rank, decoded_token}: the prompt's token first, then the k most likely (`prompt_logprobs_map`).

JSON has no -Infinity: a logprob of -inf is written as -9999.0 (what OpenAI and vLLM send).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from cluster.wire.stream_messages import PositionLogprobs
from router.openai.protocol_responses import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                              PromptLogprobs, TopLogprob)

_FLOOR = -9999.0


@dataclass(frozen=True)
class PromptStart:
    """The prompt's first token in echoed logprobs: its string, no logprob."""

    token: str


def _lp(x: float) -> float:
    return x if x >= _FLOOR else _FLOOR  # also maps NaN to the floor


class CompletionLogprobsBuilder:
    """Accumulates one completion choice's logprobs; `add` returns the part for one streamed chunk."""

    def __init__(self, k: int):
        self.k = k
        self.offset = 0
        self.all = CompletionLogprobs()

    def add(self, positions: Seq[PositionLogprobs | PromptStart]) -> CompletionLogprobs:
        part = CompletionLogprobs()
        for p in positions:
            if isinstance(p, PromptStart):
                part.tokens.append(p.token)
                part.token_logprobs.append(None)
                part.top_logprobs.append(None)
                part.text_offset.append(self.offset)
                self.offset += len(p.token)
                continue
            top = {t: _lp(lp) for t, lp in zip(p.top_tokens[: self.k], p.top_logprobs[: self.k])}
            top.setdefault(p.token, _lp(p.logprob))
            part.tokens.append(p.token)
            part.token_logprobs.append(_lp(p.logprob))
            part.top_logprobs.append(top)
            part.text_offset.append(self.offset)
            self.offset += len(p.token)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.all, name).extend(getattr(part, name))
        return part


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(positions: Seq[PositionLogprobs], k: int) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=p.token, logprob=_lp(p.logprob), bytes=_utf8(p.token), top_logprobs=[
            TopLogprob(token=t, logprob=_lp(lp), bytes=_utf8(t)) for t, lp in zip(p.top_tokens[:k], p.top_logprobs[:k])])
        for p in positions])


def prompt_logprobs_map(prompt: Seq[PositionLogprobs | None], k: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs shape. A rank is known for the top tokens (their place, from 1); the
    prompt's token outside them gets rank null."""
    out: PromptLogprobs = []
    for p in prompt:
        if p is None:
            out.append(None)
            continue
        rank = p.top_ids.index(p.token_id) + 1 if p.token_id in p.top_ids else None
        entry = {p.token_id: PromptLogprob(logprob=_lp(p.logprob), rank=rank, decoded_token=p.token)}
        for r, (t, s, lp) in enumerate(zip(p.top_ids[:k], p.top_tokens[:k], p.top_logprobs[:k]), start=1):
            entry.setdefault(t, PromptLogprob(logprob=_lp(lp), rank=r, decoded_token=s))
        out.append(entry)
    return out
