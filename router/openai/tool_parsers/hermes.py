"""Hermes / Qwen 2.5 tool calls: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
anywhere in the text (content before, between and after them; several calls in a row are parallel
calls). `<tool_call>` is an ordinary added token in these tokenizers: it is in the detokenized text."""

from __future__ import annotations

from router.openai.tool_parsers.tool_parser import ToolParser, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, id_factory=None):
        super().__init__(id_factory)
        self._buf = ""
        self._state = "content"  # content | call | close

    def _feed(self, text: str) -> None:
        buf = self._buf + text
        while buf:
            if self._state == "content":
                i = buf.find(OPEN)
                if i < 0:
                    keep = held_back(buf, OPEN)
                    self._content(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                self._content(buf[:i])
                buf = buf[i + len(OPEN):]
                self._open(OPEN)
                self._state = "call"
            elif self._state == "call":
                used = self._scan(buf)
                buf = buf[used:]
                sc = self._call.scanner
                if sc.error is not None:
                    self._close()
                    self._state = "content"
                elif sc.done:
                    self._close()
                    self._state = "close"
                else:
                    break
            else:  # after a call's object: its closing tag
                rest = buf.lstrip()
                if rest.startswith(CLOSE):
                    buf = rest[len(CLOSE):]
                    self._state = "content"
                elif CLOSE.startswith(rest):
                    break  # not all of it yet
                else:
                    self._state = "content"  # no closing tag: what follows is content
        self._buf = buf

    def _finish(self) -> None:
        if self._state == "call":
            self._close()
        elif self._state == "content":
            self._content(self._buf)
        self._buf = ""
