"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the v3 tokenizers'
format, as vLLM's mistral parser), content before it. `[TOOL_CALLS]` is a control token: the
detokenizer must keep special tokens for it to be seen. Call ids are 9 letters or digits, which
Mistral's chat templates require of the calls sent back."""

from __future__ import annotations

from router.openai.tool_parsers.tool_parser import ToolParser, alphanumeric_id, held_back

BOT = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    default_id = staticmethod(alphanumeric_id)

    def __init__(self, id_factory=None):
        super().__init__(id_factory)
        self._buf = ""
        self._state = "content"  # content | list | item | call | after_item

    def _feed(self, text: str) -> None:
        buf = self._buf + text
        while buf:
            st = self._state
            if st == "content":
                i = buf.find(BOT)
                if i < 0:
                    keep = held_back(buf, BOT)
                    self._content(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                self._content(buf[:i])
                self._opening = buf[i : i + len(BOT)]
                buf = buf[i + len(BOT):]
                self._state = "list"
            elif st in ("list", "item", "after_item"):
                rest = buf.lstrip()
                if not rest:
                    self._opening += buf  # given back with the call if none comes
                    buf = ""
                    break
                c = rest[0]
                if st == "list" and c == "[":
                    self._opening += buf[: len(buf) - len(rest) + 1]
                    buf, self._state = rest[1:], "item"
                elif st == "item" and c == "{":
                    self._open(self._opening + buf[: len(buf) - len(rest)])
                    self._opening, buf, self._state = "", rest, "call"
                elif st == "after_item" and c == ",":
                    buf, self._state = rest[1:], "item"
                elif st in ("item", "after_item") and c == "]":
                    buf, self._state, self._opening = rest[1:], "content", ""
                else:  # not the call list after all: content, verbatim
                    self._content(self._opening)
                    self._opening, self._state = "", "content"
            else:  # call
                used = self._scan(buf)
                buf = buf[used:]
                sc = self._call.scanner
                if sc.error is not None:
                    self._close()
                    self._state = "content"
                elif sc.done:
                    self._state = "after_item" if self._close() else "content"
                else:
                    break
        self._buf = buf

    _opening = ""  # "[TOOL_CALLS][" and whitespace read before the first call

    def _finish(self) -> None:
        if self._state == "call":
            self._close()
        elif self._state == "content":
            self._content(self._buf)
        elif self._opening:
            self._content(self._opening)
        self._buf = ""
