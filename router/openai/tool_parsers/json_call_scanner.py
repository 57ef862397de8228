"""JSONCallScanner: reads one tool call's JSON object, {"name": ..., "arguments": ...}, as its text
arrives, a character at a time, and reports the function's name and the arguments' text in pieces.

It tracks only the object's top level: keys, and for each value where it ends (strings with their
escapes, nested objects and arrays by depth, scalars up to the next delimiter). The arguments value
(under one of `args_keys`) is reported raw, as the model wrote it, so that the streamed pieces joined
are exactly the non-streamed arguments; an arguments value that is a JSON string (a model that
stringifies them) is decoded and reported whole at its end. Other keys are skipped.

feed(text) -> how many characters belong to the object (the rest is the caller's); `done` once the
closing brace is read, `error` (a reason) if the text is not such an object.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


class JSONCallScanner:
    def __init__(self, args_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.args_keys = args_keys
        self.name: str | None = None
        self.args_pieces: list[str] = []  # arguments text not yet taken by the caller
        self.args_seen = False  # an arguments value started
        self.done = False
        self.error: str | None = None
        self._state = "start"
        self._buf: list[str] = []  # the current key, or a value that is reported at its end
        self._escape = False
        self._in_string = False
        self._depth = 0  # nesting inside the current value
        self._key = ""
        self._target = ""  # what the current value is: "name" | "args" | "args_string" | "skip"
        self._kind = ""  # "string" | "container" | "scalar"

    def take_args(self) -> str:
        out = "".join(self.args_pieces)
        self.args_pieces.clear()
        return out

    def feed(self, text: str) -> int:
        i, n = 0, len(text)
        while i < n and not self.done and self.error is None:
            c = text[i]
            st = self._state
            if st == "start":
                if c == "{":
                    self._state = "key_or_end"
                elif c not in _WS:
                    self.error = "a tool call is a JSON object"
            elif st == "key_or_end":
                if c == '"':
                    self._state, self._buf = "key", []
                elif c == "}":
                    self.done = True
                elif c not in _WS:
                    self.error = "expected a key"
            elif st == "key":
                if self._escape:
                    self._escape = False
                    self._buf.append(c)
                elif c == "\\":
                    self._escape = True
                    self._buf.append(c)
                elif c == '"':
                    self._key = self._decode('"' + "".join(self._buf) + '"')
                    self._state = "colon"
                else:
                    self._buf.append(c)
            elif st == "colon":
                if c == ":":
                    self._state = "value_start"
                elif c not in _WS:
                    self.error = "expected ':'"
            elif st == "value_start":
                if c not in _WS:
                    self._start_value(c)
            elif st == "value":
                if self._kind == "scalar" and (c in ",}" or c in _WS):
                    self._end_value()
                    continue  # the delimiter that ends a scalar is read again, after the value
                self._value_char(c)
            elif st == "after_value":
                if c == ",":
                    self._state = "next_key"
                elif c == "}":
                    self.done = True
                elif c not in _WS:
                    self.error = "expected ',' or '}'"
            elif st == "next_key":
                if c == '"':
                    self._state, self._buf = "key", []
                elif c not in _WS:
                    self.error = "expected a key"
            i += 1
        return i

    # -- values ---------------------------------------------------------------------------------------
    def _start_value(self, c: str) -> None:
        key = self._key
        if key == "name":
            self._target = "name"
        elif key in self.args_keys and not self.args_seen:
            self.args_seen = True
            self._target = "args_string" if c == '"' else "args"
        else:
            self._target = "skip"
        self._buf, self._escape, self._depth = [], False, 0
        self._in_string = c == '"'
        self._kind = "string" if c == '"' else "container" if c in "{[" else "scalar"
        if self._kind == "container":
            self._depth = 1
        self._state = "value"
        self._emit(c)

    def _value_char(self, c: str) -> None:
        kind = self._kind
        self._emit(c)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if kind == "string":
                    self._end_value()
            return
        if kind == "container":
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value()

    def _emit(self, c: str) -> None:
        if self._target == "args":
            self.args_pieces.append(c)
        elif self._target != "skip":
            self._buf.append(c)

    def _end_value(self) -> None:
        raw = "".join(self._buf)
        if self._target == "name":
            name = self._decode(raw)
            if isinstance(name, str) and self.error is None:
                self.name = name
            elif self.error is None:
                self.error = "the function name is not a string"
        elif self._target == "args_string":
            decoded = self._decode(raw)
            if isinstance(decoded, str):
                self.args_pieces.append(decoded)
        self._state = "after_value"

    def _decode(self, raw: str):
        try:
            return json.loads(raw)
        except ValueError:
            self.error = "malformed JSON string"
            return None
