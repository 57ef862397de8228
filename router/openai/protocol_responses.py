"""OpenAI-compatible response bodies (the HTTP edge of the gateway), with the request models of
router/openai/protocol.py the OpenAPI schema the gateway serves at /openapi.json.

Our extensions (vLLM's `prompt_logprobs`) and `tool_calls` are left out of a response while unset
(`_OmitsUnset`), so that a response asking for none of them is exactly OpenAI's.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


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


class _OmitsUnset(BaseModel):
    """A response model whose listed fields (our extensions, and tool_calls) are left out while None,
    so that a response asking for none of them is exactly OpenAI's."""

    omit_unset: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        d = handler(self)
        for k in self.omit_unset:
            if d.get(k, 0) is None:
                del d[k]
        return d


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry. `rank`: the token's place in the distribution (1: the most
    likely), known for the top tokens; null for a prompt token outside them."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (the first: null), its token id and the top ones' -> their logprobs (vLLM's shape).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(_OmitsUnset):
    omit_unset: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # extension (vLLM), with prompt_logprobs


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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_OmitsUnset):
    omit_unset: ClassVar[tuple[str, ...]] = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None  # null beside tool calls when there is no text
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_OmitsUnset):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # extension (vLLM), with prompt_logprobs
    omit_unset: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # a fragment of the arguments' JSON text


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has index, id, type and the function's name; later ones
    argument fragments under the same index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    # pdserve's additions (as vLLM adds max_model_len): what the model is served with.
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None


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
