"""Forced tool calls (tool_choice "required" or a named function), as vLLM serves them: the grammar
engine writes plain JSON under a schema built from the tools (vLLM's `_get_json_schema_from_tool`),
and these parsers turn that JSON into OpenAI tool calls. The same with or without a
`--tool-call-parser`: the format parsers read "auto" replies only.

- a named tool_choice: the whole reply is the function's arguments object (its `parameters`
  schema; any object when it has none): one call of that function (`NamedCallParser`);
- "required": the reply is a JSON array of `{"name": ..., "parameters": {...}}` objects, at least one,
  each under an anyOf of the tools' schemas (at most one with parallel_tool_calls false):
  one call per element (`RequiredCallsParser`).

Why not the model's own format (`<tool_call>...</tool_call>` and the like): its wrapper is text the
grammar would make the model spell, token by token, under the mask, and a model that is not sure of
it picks fragments (SmolLM2-135M: 51 tokens for one hermes call with a 6-token arguments object,
against 10 for the object alone); and a sequence of tagged calls has no end of its own, so a model
that likes the format writes call after call until max_tokens. Here the JSON value's close is the
end of the grammar: after it only the model's EOS is allowed, and the reply stops there.

The JSON layout is the grammar engine's (no free whitespace), so every byte of it is the call's;
both parsers stream (the arguments in fragments as they are written), and a reply cut by max_tokens
ends with its last call as far as it got, as the format parsers do (an element cut before its name is
dropped: this format has no content). How many calls "required" writes with parallel calls allowed
is the model's choice (random weights may go on until max_tokens; parallel_tool_calls false closes
the array after one).
"""

from __future__ import annotations

from typing import Callable, Sequence

from cluster.errors import InvalidRequestError
from cluster.structured import StructuredOutput
from router.openai.tool_parsers.tool_parser import FunctionTool, ToolCallDelta, ToolParser

_WS = " \t\r\n"


def named_tool(tools: Sequence[FunctionTool], name: str) -> FunctionTool:
    """The tool a named tool_choice calls (a 400 naming tool_choice when no tool has that name)."""
    for t in tools:
        if t.name == name:
            return t
    raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")


def named_call_schema(tool: FunctionTool) -> StructuredOutput:
    """The arguments object of one function: its parameters schema (any object without one)."""
    return StructuredOutput.json_schema(tool.parameters if tool.parameters is not None else {"type": "object"})


def required_calls_schema(tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutput:
    """vLLM's array of calls: `[{"name": <one of the tools>, "parameters": <its schema>}, ...]`."""
    if not tools:
        raise InvalidRequestError("tool_choice needs tools", "tool_choice")
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.name]},
                             "parameters": t.parameters if t.parameters is not None else {"type": "object"}},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema)


class NamedCallParser(ToolParser):
    """The reply is the arguments of `function_name`: one call, its arguments streamed as written."""

    name = "forced_named"

    def __init__(self, function_name: str, id_factory: Callable[[], str] | None = None):
        super().__init__(id_factory)
        self.function_name = function_name

    @classmethod
    def bound(cls, function_name: str, id_factory: Callable[[], str] | None = None
              ) -> Callable[[], "NamedCallParser"]:
        return lambda: cls(function_name, id_factory)

    def _feed(self, text: str) -> None:
        if not self._calls:
            self._calls = 1
            self._out_calls.append(ToolCallDelta(0, self._new_id(), self.function_name, ""))
        self._out_calls.append(ToolCallDelta(0, arguments=text))

    def _finish(self) -> None:
        if not self._calls:  # nothing written (max_tokens 0 cannot happen; an empty reply): still its call
            self._calls = 1
            self._out_calls.append(ToolCallDelta(0, self._new_id(), self.function_name, ""))


class RequiredCallsParser(ToolParser):
    """The reply is a JSON array of calls (`{"name", "parameters"}` objects): one call per element."""

    name = "forced_required"

    def __init__(self, id_factory: Callable[[], str] | None = None):
        super().__init__(id_factory)
        self._state = "open"  # open ("[" next) | call | after (a "," or "]" next) | end

    @classmethod
    def bound(cls, id_factory: Callable[[], str] | None = None) -> Callable[[], "RequiredCallsParser"]:
        return lambda: cls(id_factory)

    def _feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self._state == "call":
                i += self._scan(text[i:])
                sc = self._call.scanner
                if sc.error is not None or sc.done:
                    self._close()
                    self._state = "after" if sc.done else "end"
                continue
            c = text[i]
            i += 1
            if c in _WS or self._state == "end":
                continue
            if self._state == "open" and c == "[" or self._state == "after" and c == ",":
                self._open()
                self._state = "call"
            else:  # "]", or anything the grammar would not have written: the calls end here
                self._state = "end"

    def _finish(self) -> None:
        if self._state == "call":
            if self._call.index < 0:  # cut by max_tokens before its name: no call, and never content
                self._call = None
            else:
                self._close()
        self._state = "end"
