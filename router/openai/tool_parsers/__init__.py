"""Tool-call parsers by `--tool-call-parser` name (vLLM's names): pure text -> OpenAI tool calls, streamed
or not, and the grammar of a valid call in each format (tool_parser.py says how)."""

from __future__ import annotations

from router.openai.tool_parsers.hermes import HermesToolParser
from router.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from router.openai.tool_parsers.mistral import MistralToolParser
from router.openai.tool_parsers.tool_parser import (FunctionCall, FunctionTool, ParsedOutput, ParserDelta, ToolCall,
                                                    ToolCallDelta, ToolParser, reassemble)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Llama3JsonToolParser, HermesToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for a `--tool-call-parser` name (ValueError naming the choices otherwise)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "FunctionCall", "FunctionTool", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "ParsedOutput", "ParserDelta", "ToolCall", "ToolCallDelta", "ToolParser",
           "get_tool_parser", "reassemble"]
