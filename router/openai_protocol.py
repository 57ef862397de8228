"""OpenAI-compatible request and response bodies (the HTTP edge of the gateway).

Requests are validated strictly: a wrong JSON type is a 400, never a silent coercion ("5" is not an
integer). Fields we accept but do not implement (echo, n > 1, ...) are rejected with a 400 naming the
parameter, rather than ignored, so a client never gets an answer it did not ask for. The sampling
fields' ranges are SamplingParams' to check (cluster/sampling_params.py); logprobs are rendered in
OpenAI's completions and chat shapes by the models at the end of this file.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import InvalidRequestError
from cluster.sampling_params import MAX_LOGPROBS

_STRICT = ConfigDict(strict=True, extra="ignore")

# Integers that reach the workers become int64 tensors: anything wider is a 400 here, never an
# overflow inside a decode step (which would fail every request on that worker).
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT
    model: str
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # extension (vLLM): 0 or -1 disables
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None  # extension (vLLM)
    seed: Int64 | None = None
    ignore_eos: bool = False  # extension (vLLM)
    min_tokens: Int64 = 0  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias
    allowed_token_ids: list[Int64] | None = None  # extension (vLLM)
    bad_words: list[str] | None = None  # extension (vLLM): never generated, whole
    user: str | None = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", "n")
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
    # A string, a list of token ids, or a one-element batch of either (batched prompts: 400).
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    logprobs: Int64 | None = None  # top logprobs per token, 0..5 (0: the sampled token's only)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", "best_of")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError("batched prompts are not supported; send one prompt per request", "prompt")
            return p[0]
        return p


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

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
