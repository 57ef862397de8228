"""OpenAI-compatible request bodies (the HTTP edge of the gateway); the response bodies are in
router/openai/protocol_responses.py.

Requests are validated strictly: a wrong JSON type is a 400, never a silent coercion ("5" is not an
integer). `null` is accepted wherever OpenAI's schema allows it and means the field's default. Every
text field rejects invalid Unicode (a lone UTF-16 surrogate, which JSON can spell as "\\ud800") with a
400: it cannot be tokenized or written back out. The models below are the one list of accepted
fields: any other key is a 400 naming it ("Unrecognized request argument supplied: ...", as OpenAI
answers; `extra="forbid"`). Fields we know but do not implement (beam search, legacy function
calling, stored completions, reasoning effort, ...: `UNSUPPORTED_FIELDS`) are rejected with a 400 naming the field
unless their value asks for nothing, never ignored, so a client never gets an answer it did not ask
for. Every other field has an effect (tests/router/openai/test_request_fields.py proves each). The sampling fields' ranges are
SamplingParams' to check (cluster/sampling/sampling_params.py). These models (with the response models) are also the OpenAPI
schema the gateway serves at /openapi.json.

Structured output (`response_format`, vLLM's `guided_*` and `structured_outputs`) and tools
(`tools`, `tool_choice`, `parallel_tool_calls`, messages with `tool_calls` and role "tool") are
declared here with their shapes; router/openai/structured_fields.py turns the former into the one
constraint a request carries, router/openai/tool_calling.py the latter into the chat template's tools,
the tool_choice grammar and the output parser.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from cluster.errors import InvalidRequestError
from cluster.sampling.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS

_STRICT = ConfigDict(strict=True, extra="forbid")

# Integers that reach the workers become int64 tensors: anything wider is a 400 here, never an
# overflow inside a decode step (which would fail every request on that worker).
INT64_MIN, INT64_END = -(2**63), 2**63
Int64 = Annotated[int, Field(ge=INT64_MIN, lt=INT64_END)]


def _int64_ids(ids: list[int]) -> list[int]:
    if ids and (min(ids) < INT64_MIN or max(ids) >= INT64_END):
        raise ValueError("token ids must be integers in [-2**63, 2**63)")
    return ids


# A prompt's token ids: Int64's bounds, checked on the whole list at C speed (min, max). As
# list[Int64], pydantic's constrained-int path took ~80 us for 2048 ids on a CPU host (~0.04 ms of
# intake on the TTFT path with this). Only the prompt's union uses it: there a refusal's message is
# the union's first member's (the string's) either way, so the client's 400 is the same.
PromptTokenIds = Annotated[list[int], AfterValidator(_int64_ids),
                           WithJsonSchema({"type": "array", "items": {"type": "integer", "minimum": INT64_MIN,
                                                                       "exclusiveMaximum": INT64_END}})]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHOICES = 128  # n times the number of prompts, per request (OpenAI's n limit)
MAX_TOOLS = 128  # OpenAI's limit of tools per request
# Lists a client sends, capped by the model before any work is done on them (pydantic checks the
# length while it parses the body: a too-long list is a 400 before tokenization or validation).
MAX_STOP_TOKEN_IDS = 256
MAX_ALLOWED_TOKEN_IDS = 32768  # a quarter of a 128k vocabulary: "these tokens only" stays usable
MAX_BAD_WORD_CHARS = 256  # per word (it must tokenize to at most 16 tokens anyway)
# Every choice of a request carries its own copy of the token-id lists (allowed_token_ids,
# stop_token_ids, logit_bias) through the router and to its worker, where each is checked again:
# choices x entries is bounded, so no body multiplies into seconds of the router's loop.
MAX_REQUEST_TOKEN_ID_ENTRIES = 1 << 18


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
    "functions": "legacy function calling is not supported; use tools",
    "function_call": "legacy function calling is not supported; use tool_choice",
    "use_beam_search": "beam search is not supported",
    "suffix": "suffix is not supported",
    "reasoning_effort": "the served model is not a reasoning model",
    "store": "stored completions are not supported (store: false is the only value)",
    "metadata": "metadata is kept with stored completions only, which are not supported",
    "service_tier": "there is one service tier ('auto' / 'default')",
    "modalities": "the only output modality is text",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    # chat messages (ChatMessage.check)
    "refusal": "an assistant message's refusal cannot be rendered (give it as content)",
}
# /v1/completions has no chat template to render tools with, nor messages to put calls in.
_CHAT_ONLY = {name: "tool calling is served by /v1/chat/completions only"
              for name in ("tools", "tool_choice", "parallel_tool_calls")}


def _no_op(name: str, value: Any) -> bool:
    """The values of an unsupported field that ask for nothing."""
    if value is None:
        return True
    if name in ("use_beam_search",):
        return value is False
    if name == "suffix":
        return value == ""
    if name == "store":
        return value is False
    if name == "metadata":
        return value == {}
    if name == "service_tier":
        return value in ("auto", "default")
    if name == "modalities":
        return value == ["text"]
    return False


def refuse_unsupported(obj: BaseModel) -> None:
    """A 400 naming the first field of the object's refusal map (its class's `unsupported`, else
    `UNSUPPORTED_FIELDS`) the object declares and sets to something other than a no-op value."""
    for name, why in getattr(type(obj), "unsupported", UNSUPPORTED_FIELDS).items():
        if name in type(obj).model_fields and not _no_op(name, getattr(obj, name)):
            raise InvalidRequestError(f"{name}: {why}", name)


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
    # vLLM's extension: every chunk carries its choice's usage so far (completion_tokens counts the
    # tokens streamed up to and including that chunk), so a client can time each token.
    continuous_usage_stats: bool | None = False


# -- structured output ------------------------------------------------------------------------------
_NESTED = ConfigDict(strict=True, extra="forbid")  # a misspelt key is a 400 too



def _valid_unicode_document(doc: Any) -> Any:
    """Every string of a JSON document (keys too) is valid Unicode: it is rendered into prompts and
    handed to the grammar engine."""
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            _valid_unicode(x)
        elif isinstance(x, dict):
            stack.extend(x)
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return doc


JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode_document)]
JSONSchema = JSONObject | bool  # a JSON schema document (its own validity is the grammar engine's to check)


class JSONSchemaFormat(_Request):
    """response_format.json_schema (OpenAI's). The schema is always enforced in full: `strict` false
    (OpenAI's best effort) gets the strict answer."""

    model_config = _NESTED
    # name and description label the format (OpenAI requires a name); neither is rendered into the
    # prompt (as vLLM): the output's contract is the schema alone. Checked here, used nowhere else.
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Text | None = None
    schema_: JSONSchema | None = Field(None, alias="schema")  # none: any JSON value
    strict: bool | None = None


class ResponseFormat(_Request):
    model_config = _NESTED
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    model_config = _NESTED
    json_: JSONSchema | Text | None = Field(None, alias="json")  # a schema, or its JSON text
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool | None = None


# -- tools ------------------------------------------------------------------------------------------
class FunctionDefinition(_Request):
    model_config = _NESTED
    name: Text
    description: Text | None = None
    parameters: JSONObject | None = None  # a JSON schema of the arguments object; none: any object
    strict: bool | None = None  # the arguments always follow `parameters` when the grammar writes the call


class ChatTool(_Request):
    model_config = _NESTED
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    model_config = _NESTED
    name: Text


class NamedToolChoice(_Request):
    model_config = _NESTED
    type: Literal["function"] = "function"
    function: NamedFunction


class MessageFunctionCall(_Request):
    model_config = _NESTED
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(_Request):
    """A call of an earlier assistant message (sent back with the tool's result)."""

    model_config = _NESTED
    id: Text
    type: Literal["function"] = "function"
    function: MessageFunctionCall


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
    stop_token_ids: Annotated[list[Int64], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # extension (vLLM)
    seed: Int64 | None = None
    ignore_eos: bool | None = False  # extension (vLLM)
    min_tokens: Int64 | None = 0  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    # token id (as a string, JSON keys are) -> bias
    logit_bias: Annotated[dict[Text, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[Int64], Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None  # extension (vLLM)
    # extension (vLLM): never generated, whole. Capped here, before any word is tokenized.
    bad_words: Annotated[list[Annotated[Text, Field(max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    user: Text | None = None  # an end user's id: logged with the request's id (as OpenAI uses it: attribution)
    skip_special_tokens: bool | None = True  # extension (vLLM): special tokens give no text
    prompt_logprobs: Int64 | None = None  # extension (vLLM): per prompt token, its logprob and this many top ones
    # Structured output: at most one of these (router/openai/structured_fields.py).
    response_format: ResponseFormat | None = None
    guided_json: JSONSchema | Text | None = None  # extension (vLLM): a schema, or its JSON text
    guided_regex: Text | None = None  # extension (vLLM)
    guided_choice: list[Text] | None = None  # extension (vLLM)
    guided_grammar: Text | None = None  # extension (vLLM): EBNF
    structured_outputs: StructuredOutputsParams | None = None  # extension (vLLM)
    # Known, not implemented: declared so that a value is a 400 naming it (`UNSUPPORTED_FIELDS`).
    functions: Any = None
    function_call: Any = None
    use_beam_search: Any = None

    unsupported: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    def check_unsupported(self) -> None:
        refuse_unsupported(self)
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_CHOICES}]", "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None:
            if not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
                raise InvalidRequestError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                                          "prompt_logprobs")
            if self.stream:  # as vLLM: they come with the whole response only
                raise InvalidRequestError("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    def check_token_id_budget(self, choices: int) -> None:
        """choices x (allowed_token_ids + stop_token_ids + logit_bias entries) is bounded (see
        MAX_REQUEST_TOKEN_ID_ENTRIES): a 400 naming the largest list otherwise."""
        sizes = {"allowed_token_ids": len(self.allowed_token_ids or ()), "stop_token_ids": len(self.stop_token_ids or ()),
                 "logit_bias": len(self.logit_bias or ())}
        if choices * sum(sizes.values()) > MAX_REQUEST_TOKEN_ID_ENTRIES:
            raise InvalidRequestError(
                f"too many token ids: {choices} choices x {sum(sizes.values())} ids in allowed_token_ids, "
                f"stop_token_ids and logit_bias exceed {MAX_REQUEST_TOKEN_ID_ENTRIES}; lower n or the lists",
                max(sizes, key=sizes.get))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or a batch of either (each prompt gets n choices).
    prompt: Union[Text, PromptTokenIds, list[Text], list[PromptTokenIds]]
    echo: bool | None = False  # the prompt's text (and with logprobs, its logprobs) before each choice's
    suffix: Text | None = None
    best_of: Int64 | None = None
    logprobs: Int64 | None = None  # top logprobs per token, 0..5 (0: the sampled token's only)
    # Chat only: declared so that a value is a 400 naming it.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    unsupported: ClassVar[dict[str, str]] = {**UNSUPPORTED_FIELDS, **_CHAT_ONLY}

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
        if self.best_of not in (None, self.n):
            raise InvalidRequestError("best_of must equal n (choosing the best of several is not supported)",
                                      "best_of")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"at most {MAX_CHOICES} choices (prompts times n) per request", "n")
        self.check_token_id_budget(len(self.prompts()) * self.n)

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
    name: Text | None = None  # the participant's name: given to the chat template (templates that read it use it)
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool's result: the call it answers
    # What OpenAI's SDK hands back for an assistant message (a client often sends it back as it is):
    # null / empty asks for nothing; anything else is a 400 naming it (UNSUPPORTED_FIELDS).
    refusal: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        return self

    def check(self) -> None:
        refuse_unsupported(self)
        if self.annotations:
            raise InvalidRequestError("annotations: message annotations (url citations) cannot be rendered",
                                      "annotations")

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        d: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            # Chat templates write a call's arguments with `| tojson`: they take them as an object (as
            # vLLM renders them); arguments that are no JSON object stay the text they are.
            d["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_object_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


def _json_object_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
        _valid_unicode_document(value)  # "\ud800" escapes decode to what no prompt can hold
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None  # the newer spelling of max_tokens
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None  # 0..20, with logprobs: true
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    # none: "auto" with tools (as OpenAI and vLLM), else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # false: at most one call per reply
    # Known, not implemented (UNSUPPORTED_FIELDS): a value that asks for something is a 400 naming it.
    reasoning_effort: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.check_token_id_budget(self.n)
        for m in self.messages:
            m.check()
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
        for m in self.messages or ():
            m.check()


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    model: Text | None = None
    tokens: list[Int64]
