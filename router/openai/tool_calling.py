"""ToolCalling: one chat request's tools, from its body to the tool calls of its reply.

- The tools are rendered by the model's chat template (`template_tools`, HF's `apply_chat_template(
  tools=...)` shape); earlier calls and tool results render from the messages (protocol.ChatMessage).
- tool_choice (none when not given: "auto" with tools, as OpenAI and vLLM):
    "none"       the tools are rendered, the reply is plain content (not parsed);
    "auto"       the model may call: the reply is parsed by the server's `--tool-call-parser`
                 (router/openai/tool_parsers/); needs `--enable-auto-tool-choice`, as vLLM does;
    "required"   the grammar engine makes the model write one or more valid calls (one when
                 parallel_tool_calls is false), as vLLM: a JSON array of {name, parameters} objects
                 (tool_parsers/forced_json.py), with or without a parser; the reply ends when the
                 array closes (only EOS is allowed after it);
    {type: function, function: {name}}: likewise, exactly one call of that function: the reply is
                 its arguments object under its schema, and ends when the object closes.
  A forced call is the same grammar and reader whatever `--tool-call-parser` says (forced_json.py
  says why not the model's own format); with a parser its call ids are in that format's style
  (Mistral's templates need 9-character ids back).
- A parsed reply keeps special tokens in its text (the detokenizer's skip_special_tokens off, as
  vLLM's parsers ask): Llama 3's <|python_tag|> and Mistral's [TOOL_CALLS] are special tokens.
- parallel_tool_calls false: at most one call per reply. Forced calls get it from the grammar; in
  "auto" a call after the first is dropped (neither content nor a call).
- A function's `strict`: the arguments follow its `parameters` whenever the grammar writes the call
  (required, named: strict or not); "auto" has no grammar (its calls are what the model wrote), so
  `strict: true` there is a 400 naming `tools` rather than a promise not kept; with "none" no call
  is made and strict asks for nothing.
- finish_reason is "tool_calls" when the reply made a call and ended by itself (a stop token: for a
  forced call, its grammar closed), a named tool_choice included (vLLM and OpenAI say "stop" there;
  a client reading finish_reason to know that calls came back is served by "tool_calls"); a reply
  cut by max_tokens says "length", its last call possibly incomplete.

Streamed, each choice has its own parser (`new_parser`): text pieces in, content and tool-call
deltas out (index, id, type and name first, then argument fragments); the non-streamed reply is the
same parser over the whole text, so a stream reassembled equals it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cluster.errors import InvalidRequestError
from cluster.structured import StructuredOutput
from router.openai.protocol import ChatCompletionRequest, NamedToolChoice
from router.openai.tool_parsers import FunctionTool, ToolCall, ToolCallDelta, ToolParser, get_tool_parser
from router.openai.tool_parsers.forced_json import (NamedCallParser, RequiredCallsParser, named_call_schema, named_tool,
                                                    required_calls_schema)


@dataclass(frozen=True)
class ToolCalling:
    tools: tuple[FunctionTool, ...]
    template_tools: tuple[dict, ...]  # what the chat template renders
    choice: str  # "none" | "auto" | "required" | "function" (a named one)
    parser: Callable[[], ToolParser] | None = None  # a new parser of the reply (None: tool_choice none)
    constraint: StructuredOutput | None = None  # the grammar of a forced call
    max_calls: int | None = None  # parallel_tool_calls false: 1

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser_name: str | None, auto_enabled: bool) -> "ToolCalling | None":
        """The request's tools (None without any); a 400 for a choice the server cannot serve."""
        if body.tools is None:
            if body.tool_choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools", "tool_choice")
            return None
        tools = tuple(FunctionTool.from_openai(t.model_dump()) for t in body.tools)
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools name a function twice", "tools")
        template = tuple(_template_tool(t) for t in tools)
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        max_calls = 1 if body.parallel_tool_calls is False else None
        if choice == "none":
            return cls(tools, template, "none")
        parser = get_tool_parser(parser_name) if parser_name is not None else None
        ids = parser.default_id if parser is not None else None  # forced calls: ids in the format's style
        if isinstance(choice, NamedToolChoice):
            tool = named_tool(tools, choice.function.name)
            return cls(tools, template, "function", NamedCallParser.bound(tool.name, ids), named_call_schema(tool), 1)
        if choice == "required":
            return cls(tools, template, "required", RequiredCallsParser.bound(ids),
                       required_calls_schema(tools, max_calls is None), max_calls)
        if not (auto_enabled and parser is not None):
            raise InvalidRequestError('tool_choice "auto" (the default with tools) needs the server started with '
                                      "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        strict = [t.function.name for t in body.tools if t.function.strict]
        if strict:  # the grammar writes forced calls only: an "auto" call is what the model wrote
            raise InvalidRequestError(
                f"strict function tools ({', '.join(strict)}) are enforced only when tool_choice forces a "
                'call ("required" or a named function); with tool_choice "auto" send strict false or none',
                "tools")
        return cls(tools, template, "auto", parser, max_calls=max_calls)

    @property
    def parses(self) -> bool:
        """The reply is read for tool calls (and keeps its special tokens for that)."""
        return self.parser is not None

    def new_parser(self) -> ToolParser:
        return self.parser()

    def parse(self, text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
        """A whole reply: (content, or None beside calls without any; the calls it may have)."""
        out = self.parser().parse_all(text)
        return out.content, out.tool_calls[: self.max_calls]

    def kept_deltas(self, deltas: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
        """The streamed deltas of the calls a reply may have (the first max_calls)."""
        if self.max_calls is None:
            return deltas
        return tuple(d for d in deltas if d.index < self.max_calls)

    def finish_reason(self, called: bool, finish: str | None) -> str | None:
        return "tool_calls" if called and finish == "stop" else finish


def _template_tool(t: FunctionTool) -> dict:
    fn: dict = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    fn["parameters"] = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}
