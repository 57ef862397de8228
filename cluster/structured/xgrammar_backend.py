r"""The xgrammar backend (what vLLM and SGLang default to): JSON schema, json_object, regex, choice, EBNF
and tagged JSON (xgrammar's structural tags) for one tokenizer.

Vocabulary: built from the tokenizer with every special token (the special ones of its map and every
added token marked special: Llama 3's reserved ones, `<|python_tag|>`) blanked, so that the grammar never
allows one (the detokenizer drops special tokens from the text: a `<s>` inside a JSON string would
be allowed by the grammar and missing from the output); the stop tokens are the model's EOS ids,
allowed only where the grammar is complete. Ids between the tokenizer's size and the model's vocab
size (padding) are never allowed either.

JSON layout: no free whitespace (any_whitespace=False: ", " and ": " separators, one line), so that
a weak or random model cannot emit whitespace without end; strict mode (no properties the schema does
not name). json_object is any object (strict mode off). Tagged JSON allows at most
TAGGED_MAX_WHITESPACE whitespace characters between tokens of its JSON values.

Workaround (xgrammar 0.2.9): a string with minLength/maxLength compiles to `[^"\\\r\n]{m,n}`,
which lets raw control characters into the string (invalid JSON). Such strings are given to xgrammar
as the equivalent pattern `^[^"\\\x00-\x1f]{m,n}$` instead (its pattern strings exclude quotes and
backslashes as its length rule does, and these exclude the control characters too).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import torch
import xgrammar as xgr

from cluster.errors import InvalidRequestError
from cluster.structured.grammar import GrammarBackend, GrammarMatcher
from cluster.structured.structured_output import PARAM, StructuredOutput, TaggedJSON

TAGGED_MAX_WHITESPACE = 2
# A step's bitmasks are filled on several host threads (xgrammar's BatchGrammarMatcher) once there are
# enough tokens to scan for the handoff to pay (64 rows of a 128k vocabulary: milliseconds serially);
# fewer are filled on the caller's thread.
_FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
_BATCH_FILL_MIN_TOKENS = 1 << 20
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")  # "[15:39:30] /project/cpp/x.cc:94: "


def _clean(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    msg = _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__
    return msg.replace("Check failed: (error.empty()) is false: ", "")[:500]


_DATA_KEYS = frozenset(("const", "enum", "default", "examples", "example"))  # values, not schemas


def _string_lengths_as_patterns(node: Any) -> Any:
    """The schema with every length-bounded string rewritten as a pattern (see the module docstring)."""
    if isinstance(node, list):
        return [_string_lengths_as_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else _string_lengths_as_patterns(v)) for k, v in node.items()}
    t = out.get("type")
    is_string = t == "string" or (isinstance(t, list) and "string" in t)
    bounded = "minLength" in out or "maxLength" in out
    if is_string and bounded and not ({"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", None)
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):
            out["pattern"] = r'^[^"\\\x00-\x1f]{%d,%s}$' % (lo, "" if hi is None else hi)
        else:  # not integers: let xgrammar report the schema as it is
            out["minLength"], out["maxLength"] = lo, hi
    return out


def _json_schema(spec: str) -> str:
    return json.dumps(_string_lengths_as_patterns(json.loads(spec)), ensure_ascii=False)


def _choice_ebnf(options: Sequence[str]) -> str:
    # JSON string literals are valid EBNF literals in xgrammar's dialect (\" \\ \n \t \uXXXX).
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _structural_tag(t: TaggedJSON) -> str:
    content = lambda schema: {"type": "json_schema", "json_schema": _string_lengths_as_patterns(schema),  # noqa: E731
                              "max_whitespace_cnt": TAGGED_MAX_WHITESPACE}
    body = {"type": "tags_with_separator",
            "tags": [{"type": "tag", "begin": tag.begin, "content": content(tag.schema), "end": tag.end}
                     for tag in t.tags],
            "separator": t.separator, "at_least_one": t.at_least_one, "stop_after_first": t.stop_after_first}
    elements = ([{"type": "const_string", "value": t.prefix}] if t.prefix else []) + [body] + (
        [{"type": "const_string", "value": t.suffix}] if t.suffix else [])
    fmt = body if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("m",)

    def __init__(self, m: xgr.GrammarMatcher):
        self.m = m

    def accept_token(self, token_id: int) -> bool:
        return self.m.accept_token(token_id)

    def fill_bitmask(self, out: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(out, row)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarBackend(GrammarBackend):
    @classmethod
    def check(cls, so: StructuredOutput) -> None:
        try:
            if so.kind == "json":
                xgr.Grammar.from_json_schema(_json_schema(so.spec), any_whitespace=False, strict_mode=True)
            elif so.kind == "regex":
                xgr.Grammar.from_regex(so.spec)
            elif so.kind == "grammar":
                xgr.Grammar.from_ebnf(so.spec)
            elif so.kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(so.choices()))
            elif so.kind == "tagged_json":
                xgr.Grammar.from_structural_tag(_structural_tag(so.tagged_json()))
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                    "tagged_json": "tool-call schema"}[so.kind]
            raise InvalidRequestError(f"invalid {what}: {_clean(e)}", PARAM) from None

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        stops = sorted(set(stop_token_ids)) or None
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        encoded = [""] * vocab_size
        for token, i in tokenizer.get_vocab().items():
            if i < vocab_size:
                encoded[i] = token
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        for i in special:
            if i < vocab_size:
                encoded[i] = ""  # an empty token is a special one to xgrammar: never allowed
        self.info = xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                                      stop_token_ids=detected.stop_token_ids,
                                      add_prefix_space=detected.add_prefix_space)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)  # cached above us
        self._batch = xgr.BatchGrammarMatcher(_FILL_THREADS)

    def compile(self, so: StructuredOutput) -> Any:
        c = self.compiler
        if so.kind == "json":
            return c.compile_json_schema(_json_schema(so.spec), any_whitespace=False, strict_mode=True)
        if so.kind == "json_object":
            return c.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "grammar":
            return c.compile_grammar(so.spec)
        if so.kind == "choice":
            return c.compile_grammar(_choice_ebnf(so.choices()))
        if so.kind == "tagged_json":
            return c.compile_structural_tag(_structural_tag(so.tagged_json()))
        raise AssertionError(so.kind)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def export(self) -> str:
        return self.info.serialize_json()  # the vocabulary as built above, stop tokens included

    @classmethod
    def from_export(cls, data: str, vocab_size: int) -> "XGrammarBackend":
        self = cls.__new__(cls)
        self.info = xgr.TokenizerInfo.deserialize_json(data)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._batch = None  # a compile process fills no bitmask
        return self

    def serialize(self, compiled: Any) -> str:
        return compiled.serialize_json()

    def deserialize(self, data: str) -> Any:
        return xgr.CompiledGrammar.deserialize_json(data, self.info)

    def nbytes(self, compiled: Any) -> int:
        return compiled.memory_size_bytes

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], out: torch.Tensor, rows: Sequence[int]) -> None:
        if _FILL_THREADS == 1 or len(matchers) * self.vocab_size < _BATCH_FILL_MIN_TOKENS:
            for m, r in zip(matchers, rows):
                m.m.fill_next_token_bitmask(out, r)
            return
        self._batch.batch_fill_next_token_bitmask([m.m for m in matchers], out, list(rows))
