"""ToolParser: turns a model's text into content and tool calls, in OpenAI's shape, as it streams.

A parser is fed the text deltas of one choice (`feed`), then `finish()`; each returns a ParserDelta:
the content to show and the tool-call deltas (OpenAI's `choices[].delta.tool_calls[]`: the first
delta of a call carries its index, id and function name with empty arguments, later ones argument
fragments). `parse(text)` is the non-streamed answer: the same machine fed the whole text, its deltas
joined (`reassemble`), so a stream reassembled always equals the non-streamed call.

Content that could still turn into a call's opening tag is held back until it cannot; once a call
has started, whitespace alone between or after calls is not content. A call opened but never valid
(no function name: not JSON, or not a call) is given back as content, verbatim.

A format parser reads replies the model wrote freely (tool_choice "auto"); a forced call is written
by the grammar engine in vLLM's plain JSON and read by forced_json.py's parsers, whatever the format.

Formats (one file each): llama3_json.py, hermes.py, mistral.py; the registry is this package's
__init__ (keyed by the `--tool-call-parser` name).
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

from cluster.errors import InvalidRequestError
from router.openai.tool_parsers.json_call_scanner import JSONCallScanner


@dataclass(frozen=True)
class FunctionTool:
    """One entry of a request's `tools` (type "function")."""

    name: str
    parameters: dict | None = None  # a JSON schema of the arguments object; None: any object
    description: str | None = None

    @classmethod
    def from_openai(cls, tool: dict) -> "FunctionTool":
        """From {"type": "function", "function": {"name", "parameters", "description"}}."""
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError("each tool is {type: function, function: {name, parameters}}", "tools")
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(
                ch.isalnum() or ch in "_-" for ch in name):
            raise InvalidRequestError("a function name is 1 to 64 letters, digits, '_' or '-'", "tools")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"function {name}: parameters must be a JSON schema object", "tools")
        desc = fn.get("description")
        return cls(name, params, desc if isinstance(desc, str) else None)


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True)
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, in a call's first delta only
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d["function"] = fn
        return d


@dataclass(frozen=True)
class ParserDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there is none (OpenAI's content: null beside tool calls)
    tool_calls: tuple[ToolCall, ...] = ()


def reassemble(deltas: Iterable[ToolCallDelta]) -> tuple[ToolCall, ...]:
    """Joins streamed tool-call deltas into calls (by index, in order)."""
    calls: dict[int, list] = {}
    for d in deltas:
        c = calls.setdefault(d.index, [None, None, []])
        if d.id is not None:
            c[0], c[1] = d.id, d.name
        c[2].append(d.arguments)
    return tuple(ToolCall(c[0], FunctionCall(c[1], "".join(c[2]))) for _, c in sorted(calls.items()))


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag` (kept until known)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class _OpenCall:
    scanner: JSONCallScanner
    raw: list[str] = field(default_factory=list)  # the call's text, given back as content if it is no call
    index: int = -1  # assigned once its name is known (the call is then committed)


class ToolParser(ABC):
    """One choice's parser (stateful). Subclasses define the format: the streaming machine in
    `_feed` and `_finish`."""

    name: ClassVar[str] = ""

    def __init__(self, id_factory: Callable[[], str] | None = None):
        self._new_id = id_factory or self.default_id
        self._calls = 0  # committed calls so far
        self._call: _OpenCall | None = None
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []
        self._finished = False
        self._strip_lead = False  # after a call: its trailing whitespace is not content
        self._pending_ws = ""

    default_id = staticmethod(openai_call_id)

    # -- the API -------------------------------------------------------------------------------------
    def feed(self, text: str) -> ParserDelta:
        assert not self._finished, "feed after finish"
        if text:
            self._feed(text)
        return self._take()

    def finish(self) -> ParserDelta:
        """The text is complete: held-back text is content; an unfinished call ends as it is."""
        if not self._finished:
            self._finished = True
            self._finish()
        return self._take()

    @classmethod
    def parse(cls, text: str, id_factory: Callable[[], str] | None = None) -> ParsedOutput:
        return cls(id_factory).parse_all(text)

    def parse_all(self, text: str) -> ParsedOutput:
        """This (new) parser over a whole reply."""
        deltas = [self.feed(text), self.finish()]
        content = "".join(d.content for d in deltas)
        calls = reassemble(c for d in deltas for c in d.tool_calls)
        return ParsedOutput(content if content or not calls else None, calls)

    @property
    def called(self) -> bool:
        """Some tool call was made (finish_reason "tool_calls")."""
        return self._calls > 0

    # -- for the formats -----------------------------------------------------------------------------
    @abstractmethod
    def _feed(self, text: str) -> None: ...

    @abstractmethod
    def _finish(self) -> None: ...

    def _content(self, text: str) -> None:
        """Text outside calls. Before the first call it is content as it is; after one, the whitespace
        around calls is not (held until text follows it, dropped at the end)."""
        if not text:
            return
        if not self._calls:
            self._out_content.append(text)
            return
        if self._strip_lead:
            text = text.lstrip()
            if not text:
                return
            self._strip_lead = False
        body = text.rstrip()
        if body:
            self._out_content.append(self._pending_ws + body)
            self._pending_ws = text[len(body):]
        else:
            self._pending_ws += text

    def _open(self, opening: str = "") -> None:
        """A call starts; `opening`: the text that opened it (given back with it if it is no call)."""
        self._call = _OpenCall(JSONCallScanner(), [opening] if opening else [])

    def _scan(self, text: str) -> int:
        """Feeds the open call; returns the characters it took (the rest follows the call)."""
        call = self._call
        used = call.scanner.feed(text)
        call.raw.append(text[:used])
        sc = call.scanner
        if call.index < 0 and sc.name is not None:
            call.index = self._calls
            self._calls += 1
            self._out_calls.append(ToolCallDelta(call.index, self._new_id(), sc.name, ""))
        if call.index >= 0:
            args = sc.take_args()
            if args:
                self._out_calls.append(ToolCallDelta(call.index, arguments=args))
        return used

    def _close(self) -> bool:
        """Ends the open call; False (its text given back as content) if it never was one."""
        call, self._call = self._call, None
        if call.index >= 0:
            self._strip_lead, self._pending_ws = True, ""
            return True
        self._content("".join(call.raw))
        return False

    def _take(self) -> ParserDelta:
        d = ParserDelta("".join(self._out_content), tuple(self._out_calls))
        self._out_content.clear()
        self._out_calls.clear()
        return d


def alphanumeric_id(length: int = 9) -> str:
    """Mistral's tool-call ids: 9 letters or digits (its chat template checks them)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))
