"""A request's life inside one engine or worker: tokens, KV blocks, sampling state, stop checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.text.detokenizer import IncrementalDetokenizer
from cluster.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.structured.request_grammar import RequestGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for prefill
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, KV transfer in flight
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the request's seed or one drawn at admission
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V are in this worker's cache
    block_hashes: list[bytes] = field(default_factory=list)  # addresses of its full blocks (cluster.kv.block_hash)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # A migrated request's prompt ends with the tokens it generated before the move
    # (GenerateRequest.resumed_tokens): penalties and bad words count those as generated.
    resumed_tokens: int = 0
    # With params.logprobs / prompt_logprobs (engine only; workers stream them in TokenDeltas).
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    # Structured output (params.structured): the grammar every token is accepted into, here.
    grammar: RequestGrammar | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    # stop_token_ids, plus the EOS tokens unless ignore_eos: one membership test per token.
    _stops: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        p = self.params
        self._stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token the request generated, also before a migration: what presence and frequency
        penalties and bad words read (its output here, after the prompt tokens it resumed from)."""
        if not self.resumed_tokens:
            return self.output_token_ids
        return self.prompt_token_ids[len(self.prompt_token_ids) - self.resumed_tokens:] + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token(self, token_id: int) -> str | None:
        """Records a sampled token; returns the finish reason if the sequence must stop now. With a
        grammar: the token advances it; a refused token ends the sequence with "error", a grammar
        that accepted its stop token (complete) with "stop" (min_tokens and ignore_eos cannot extend
        it: nothing may follow)."""
        self.output_token_ids.append(token_id)
        n, p = len(self.output_token_ids), self.params
        g = self.grammar
        if g is not None:
            if not g.accept(token_id):
                self.finish_reason, self.error = "error", g.error
                return self.finish_reason
            if g.is_terminated():
                self.finish_reason = "stop"
        if token_id in self._stops and n >= p.min_tokens:
            self.finish_reason = "stop"
        if self.detokenizer is not None and self.finish_reason is None:
            self.detokenizer.add(token_id)
            if self.detokenizer.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and n >= p.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason
