"""OpenAI-compatible request and response bodies (the HTTP edge of the gateway).

Requests are validated strictly: a wrong JSON type is a 400, never a silent coercion ("5" is not an
integer). `null` is accepted wherever OpenAI's schema allows it and means the field's default. Every
text field rejects invalid Unicode (a lone UTF-16 surrogate, which JSON can spell as "\\ud800") with a
400: it cannot be tokenized or written back out. Fields we know but do not implement (tools,
structured output, ...: `UNSUPPORTED_FIELDS`) are rejected with a 400 naming the field, never
ignored, so a client never gets an answer it did not ask for. The sampling fields' ranges are
SamplingParams' to check (cluster/sampling_params.py). These models are also the OpenAPI schema the
gateway serves at /openapi.json.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from cluster.errors import InvalidRequestError
from cluster.sampling_params import MAX_LOGPROBS

_STRICT = ConfigDict(strict=True, extra="ignore")

# Integers that reach the workers become int64 tensors: anything wider is a 400 here, never an
# overflow inside a decode step (which would fail every request on that worker).
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHOICES = 128  # n times the number of prompts, per request (OpenAI's n limit)


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("invalid Unicode (a lone UTF-16 surrogate)") from None
    return s


# Every string a client sends: valid Unicode (what the tokenizer and the JSON encoder need).
Text = Annotated[str, AfterValidator(_valid_unicode)]

# Known fields that are not implemented: any value but null (or the listed no-op) is a 400 naming it.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output (json_object, json_schema) is not supported; only type text",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
    "structured_outputs": "guided decoding is not supported",
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported (use echo with logprobs)",
    "suffix": "suffix is not supported",
}


def _no_op(name: str, value: Any) -> bool:
    """The values of an unsupported field that ask for nothing."""
    if value is None:
        return True
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1
    if name in ("use_beam_search",):
        return value is False
    if name == "suffix":
        return value == ""
    return False


class _Request(BaseModel):
    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI's clients send `"stream": null`, `"n": null`, ...: null means "not given". Required
        # fields stay required (a null model or prompt is a 400).
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required())}
        return data


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # extension (vLLM): 0 or -1 disables
    n: Int64 | None = 1  # choices per prompt; with a seed, choice i samples with seed + i (as vLLM)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None  # extension (vLLM)
    seed: Int64 | None = None
    ignore_eos: bool | None = False  # extension (vLLM)
    min_tokens: Int64 | None = 0  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    logit_bias: dict[Text, float] | None = None  # token id (as a string, JSON keys are) -> bias
    allowed_token_ids: list[Int64] | None = None  # extension (vLLM)
    bad_words: list[Text] | None = None  # extension (vLLM): never generated, whole
    user: Text | None = None
    # Known, not implemented: declared so that a value is a 400 naming it (`UNSUPPORTED_FIELDS`).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None

    def check_unsupported(self) -> None:
        for name, why in UNSUPPORTED_FIELDS.items():
            if name in type(self).model_fields and not _no_op(name, getattr(self, name)):
                raise InvalidRequestError(f"{name}: {why}", name)
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_CHOICES}]", "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or a batch of either (each prompt gets n choices).
    prompt: Union[Text, list[Int64], list[Text], list[list[Int64]]]
    echo: bool | None = False  # the prompt's text (and with logprobs, its logprobs) before each choice's
    suffix: Text | None = None
    best_of: Int64 | None = None
    logprobs: Int64 | None = None  # top logprobs per token, 0..5 (0: the sampled token's only)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
        if self.best_of not in (None, self.n):
            raise InvalidRequestError("best_of must equal n (choosing the best of several is not supported)",
                                      "best_of")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"at most {MAX_CHOICES} choices (prompts times n) per request", "n")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextContentPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None  # the newer spelling of max_tokens
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None  # 0..20, with logprobs: true
    parallel_tool_calls: bool | None = None  # only meaningful with tools (which are a 400)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs: true", "top_logprobs")
            if not (0 <= self.top_logprobs <= MAX_LOGPROBS):
                raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token for SamplingParams.logprobs (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True  # prompt only (the chat template carries its own)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    model: Text | None = None
    tokens: list[Int64]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# -- responses ------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached_tokens, prompt_tokens)))


class CompletionLogprobs(BaseModel):
    """Legacy completions shape: per token its string, logprob, top alternatives and text offset."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def of(cls, message: str, type: str, param: str | None = None, code: str | int | None = None) -> "ErrorResponse":
        return cls(error=ErrorInfo(message=message, type=type, param=param, code=code))
