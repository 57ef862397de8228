"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (several
separated by `;`), optionally after `<|python_tag|>`. A reply that does not open with either is content
(as vLLM's llama3_json parser). `<|python_tag|>` is a special token: the detokenizer must keep special
tokens for it to be seen (a reply opening with `{` needs nothing)."""

from __future__ import annotations

from router.openai.tool_parsers.tool_parser import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, id_factory=None):
        super().__init__(id_factory)
        self._buf = ""
        self._state = "start"  # start | call | separator | content

    def _feed(self, text: str) -> None:
        buf = self._buf + text
        while buf:
            st = self._state
            if st == "start":
                rest = buf.lstrip()
                if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
                    break  # undecided yet
                if rest.startswith(PYTHON_TAG):
                    self._open(buf[: len(buf) - len(rest)] + PYTHON_TAG)
                    buf = rest[len(PYTHON_TAG):]
                    self._state = "call"
                elif rest[0] == "{":
                    self._open(buf[: len(buf) - len(rest)])
                    buf = rest
                    self._state = "call"
                else:
                    self._state = "content"
            elif st == "call":
                used = self._scan(buf)
                buf = buf[used:]
                sc = self._call.scanner
                if sc.error is not None:
                    self._close()
                    self._state = "content"
                elif sc.done:
                    self._state = "separator" if self._close() else "content"
                else:
                    break
            elif st == "separator":  # between calls: `;`, whitespace, then the next call
                rest = buf.lstrip(" \t\r\n;")
                if not rest:
                    break  # kept: not content unless text follows
                if rest[0] == "{":
                    buf = rest
                    self._open()
                    self._state = "call"
                else:
                    self._state = "content"
            else:
                self._content(buf)
                buf = ""
        self._buf = buf

    def _finish(self) -> None:
        if self._state == "call":
            self._close()
        elif self._state in ("start", "content"):
            self._content(self._buf)
        self._buf = ""  # after the last call: separators and whitespace are no content
