"""Per-request sampling and stopping parameters (immutable once the request is admitted).

Every field is validated here with a message fit for an HTTP 400; token ids are checked against the
model's vocabulary by `check_token_ids` (the vocabulary is not known here), which every worker calls
before a request's ids can reach a kernel. What each field does to the logits, and in which order,
is `cluster.logits_processing` (processing) and `cluster.sampling.sampler` (min_p, top-k, top-p, the draw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from cluster.errors import InvalidRequestError
from cluster.structured.structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI
MAX_BAD_WORDS = 64  # token sequences per request (after tokenization: a word may give two)
MAX_BAD_WORD_TOKENS = 16  # tokens per banned sequence
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's chat limit)
MAX_ALLOWED_TOKEN_IDS = 1 << 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bias_pairs(bias) -> tuple:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or pairs; validate() checks them."""
    try:
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else tuple(tuple(kv) for kv in bias)
        return tuple(sorted(pairs, key=lambda kv: kv[0]))
    except (TypeError, ValueError, IndexError):
        raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias") from None


@dataclass(frozen=True)
class SamplingParams:
    # 0 only to score a prompt (prompt_logprobs set): the request ends right after its prefill.
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with probability >= min_p * the top token's (after temperature)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI: logits -= presence * (count > 0) + frequency * count, over the generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM / HF: logits of tokens in the prompt or generated, divided by it if > 0, else multiplied.
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit (a dict is accepted and kept as sorted (id, bias) pairs).
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these
    # Banned token sequences: the last token of one is banned when the others were just generated.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # per generated token: its logprob and this many top ones (0: its own only)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # The output must match this (JSON schema, regex, choice, grammar ...: cluster.structured); the
    # grammar's mask is applied after logits processing, before the draw, at every token.
    structured: StructuredOutput | None = None
    # Special tokens give no text (False: they do; a tool-call parser whose opening tag is a special
    # token, such as Llama 3's <|python_tag|>, needs them). The tokens and their logprobs are the same.
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) if isinstance(w, (list, tuple)) else w
                                                              for w in self.bad_words_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param)

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            bad("max_tokens must be >= 1 (0 only scores the prompt: with prompt logprobs)", "max_tokens")
        if not _is_number(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be a number in [0, 100], got {self.temperature!r}", "temperature")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                bad(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_LEN} characters", "stop")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers", "stop_token_ids")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2.0 <= v <= 2.0):
                bad(f"{name} must be a number in [-2, 2], got {v!r}", name)
        if not _is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 10.0):
            bad(f"repetition_penalty must be a number in (0, 10], got {self.repetition_penalty!r}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}", "logit_bias")
        seen = set()
        for kv in self.logit_bias:
            if len(kv) != 2 or not _is_int(kv[0]) or kv[0] < 0:
                bad("logit_bias keys must be token ids (non-negative integers)", "logit_bias")
            if not _is_number(kv[1]) or not (-100.0 <= kv[1] <= 100.0):
                bad(f"logit_bias values must be numbers in [-100, 100], got {kv[1]!r} for token {kv[0]}", "logit_bias")
            if kv[0] in seen:
                bad(f"logit_bias names token {kv[0]} twice", "logit_bias")
            seen.add(kv[0])
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS or not all(_is_int(t) and t >= 0 for t in ids):
                bad("allowed_token_ids must be a non-empty list of token ids (non-negative integers)",
                    "allowed_token_ids")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            bad(f"at most {MAX_BAD_WORDS} bad word token sequences, got {len(self.bad_words_token_ids)}", "bad_words")
        for w in self.bad_words_token_ids:
            if (not isinstance(w, tuple) or not (1 <= len(w) <= MAX_BAD_WORD_TOKENS)
                    or not all(_is_int(t) and t >= 0 for t in w)):
                bad(f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} token ids (non-negative integers)", "bad_words")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not (0 <= v <= MAX_LOGPROBS)):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}", name)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured must be a StructuredOutput", "structured_output")
        if not isinstance(self.skip_special_tokens, bool):
            bad("skip_special_tokens must be a boolean", "skip_special_tokens")

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the parameters name lies in the model's vocabulary (a 400 otherwise): ids
        reach the sampling kernels as indices."""
        def check(ids, param):
            for t in ids:
                if t >= vocab_size:
                    raise InvalidRequestError(f"{param}: token id {t} is outside the vocabulary (size {vocab_size})",
                                              param)
        check((t for t, _ in self.logit_bias), "logit_bias")
        check(self.allowed_token_ids or (), "allowed_token_ids")
        check((t for w in self.bad_words_token_ids for t in w), "bad_words")

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0: prompt logprobs, no token (lm-eval's log-likelihood requests)."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_top_k_top_p(self) -> bool:
        """Some token is cut before the draw (top-k, top-p or min_p): the sampler's filtered path."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits at every prompt position: such a request computes its
        whole prompt (its blocks are still cached for others)."""
        return self.prompt_logprobs is None

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_processing(self) -> bool:
        """The logits are changed before sampling (cluster.logits_processing): the decode step's
        features variant, with per-sequence state on the device."""
        return (self.needs_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    @property
    def needs_features(self) -> bool:
        """Processing or logprobs: the decode step runs its features variant for this request."""
        return self.needs_processing or self.logprobs is not None
