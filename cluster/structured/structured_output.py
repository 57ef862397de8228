"""StructuredOutput: what a request's output must match, as one frozen value (kind + spec).

It rides in `SamplingParams.structured` through every typed message (gateway -> router -> prefill ->
decode, and a migration's resubmission), so any worker can rebuild the request's grammar; `key`
names its compiled grammar in the caches (cluster.structured.grammar_compiler). Every kind is one
string `spec`, canonical so that equal constraints share a compiled grammar:

  json         a JSON schema (compact JSON text, key order kept: it is the output's order)
  json_object  any JSON object (OpenAI's response_format json_object); spec ""
  regex        a regular expression the whole output matches
  choice       one of a list of strings (spec: the JSON array of them)
  grammar      an EBNF grammar (xgrammar's GBNF dialect, root rule `root`)
  tagged_json  a sequence of JSON values, each wrapped in its tag's begin/end strings, between a
               prefix and a suffix: tool calls in a model's own format (router/openai/tool_parsers/
               builds them). spec: JSON {"prefix", "tags": [{"begin", "schema", "end"}, ...],
               "separator", "suffix", "at_least_one", "stop_after_first"}; see `TaggedJSON`.

What is checked here is the shape (kind known, spec well formed, sizes bounded: the spec's length, and
every repetition count it asks for, since a grammar engine unrolls a count into that many states:
`{"maxLength": 5000}` costs xgrammar over a minute of CPU, `{0,1000}` a second); whether a schema,
regex or grammar is one the backend can compile is `GrammarCompiler.check`, still before admission.
Errors are InvalidRequestError with param "structured_output": the gateway names its own field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from cluster.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tagged_json")
MAX_SPEC_CHARS = 128 * 1024  # a schema or grammar larger than this is refused (compile time grows with it)
# Repetition counts (a regex's or grammar's {n,m}, a schema's minLength/maxItems/...): each at most
# MAX_REPETITION, and all of a spec's together at most MAX_REPETITION_TOTAL (nesting multiplies them).
MAX_REPETITION = 1024
MAX_REPETITION_TOTAL = 2048
_COUNT_KEYWORDS = frozenset(("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                             "minContains", "maxContains"))
_SCHEMA_DATA_KEYS = frozenset(("const", "enum", "default", "examples", "example"))  # values, not schemas
_BRACE_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
MAX_CHOICES = 1024
MAX_TAGS = 128
PARAM = "structured_output"


def _bad(msg: str):
    raise InvalidRequestError(msg, PARAM)


def _text_counts(text: str) -> list[int]:
    """The counts of a regex's or an EBNF grammar's {n}, {n,} and {n,m} (a literal "{3}" inside a
    grammar's string counts too: a cautious over-count)."""
    return [int(x) if len(x) <= 18 else 2**62 for m in _BRACE_COUNT.finditer(text) for x in m.groups() if x]


def _schema_counts(schema) -> list[int]:
    """Every repetition count of a JSON schema: its count keywords, and those of its patterns."""
    counts, stack = [], [schema]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                if k in _SCHEMA_DATA_KEYS:
                    continue
                if k in _COUNT_KEYWORDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                    counts.append(int(min(v, 2**62)) if v == v else 0)  # NaN: the engine refuses it
                elif k == "pattern" and isinstance(v, str):
                    counts.extend(_text_counts(v))
                else:
                    stack.append(v)
    return counts


def _check_repetitions(counts: list[int]) -> None:
    if any(c > MAX_REPETITION for c in counts):
        _bad(f"a repetition count of {max(counts)} (a {{n,m}}, or a schema's minLength/maxLength/minItems/"
             f"maxItems/...) is more than {MAX_REPETITION}: the grammar would unroll it into that many states")
    if sum(counts) > MAX_REPETITION_TOTAL:
        _bad(f"the repetition counts of the spec add up to {sum(counts)}, more than {MAX_REPETITION_TOTAL}")


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        _bad(f"structured output spec is not JSON-serialisable: {e}")


def _load(spec: str, what: str):
    try:
        return json.loads(spec)
    except (ValueError, RecursionError) as e:
        _bad(f"{what} is not valid JSON: {e}")


@dataclass(frozen=True)
class JSONTag:
    """One alternative of a tagged_json sequence: `begin`, a JSON value matching `schema`, `end`."""

    begin: str
    schema: Any  # a JSON schema (dict or bool)
    end: str


@dataclass(frozen=True)
class TaggedJSON:
    """The parsed spec of a tagged_json constraint:
    prefix (tag (separator tag)*)? suffix, where each tag is one of `tags`; at_least_one drops the
    empty sequence, stop_after_first allows exactly one tag."""

    prefix: str
    tags: tuple[JSONTag, ...]
    separator: str = ""
    suffix: str = ""
    at_least_one: bool = True
    stop_after_first: bool = False

    def to_spec(self) -> str:
        return _compact({"prefix": self.prefix, "tags": [{"begin": t.begin, "schema": t.schema, "end": t.end}
                                                          for t in self.tags],
                         "separator": self.separator, "suffix": self.suffix, "at_least_one": self.at_least_one,
                         "stop_after_first": self.stop_after_first})

    @classmethod
    def from_spec(cls, spec: str) -> "TaggedJSON":
        d = _load(spec, "tagged_json spec")
        if not isinstance(d, dict) or set(d) - {"prefix", "tags", "separator", "suffix", "at_least_one",
                                                 "stop_after_first"}:
            _bad("tagged_json spec must be an object with prefix, tags, separator, suffix, at_least_one, "
                 "stop_after_first")
        tags = d.get("tags")
        if not isinstance(tags, list) or not (1 <= len(tags) <= MAX_TAGS):
            _bad(f"tagged_json needs 1 to {MAX_TAGS} tags")
        out = []
        for t in tags:
            if (not isinstance(t, dict) or set(t) != {"begin", "schema", "end"} or not isinstance(t["begin"], str)
                    or not isinstance(t["end"], str) or not isinstance(t["schema"], (dict, bool))):
                _bad("each tagged_json tag is {begin: string, schema: JSON schema, end: string}")
            out.append(JSONTag(t["begin"], t["schema"], t["end"]))
        strings = {k: d.get(k, "") for k in ("prefix", "separator", "suffix")}
        flags = {k: d.get(k, dflt) for k, dflt in (("at_least_one", True), ("stop_after_first", False))}
        if not all(isinstance(v, str) for v in strings.values()) or not all(isinstance(v, bool) for v in flags.values()):
            _bad("tagged_json prefix, separator and suffix are strings; at_least_one, stop_after_first booleans")
        return cls(strings["prefix"], tuple(out), strings["separator"], strings["suffix"], **flags)


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            _bad(f"unknown structured output kind {self.kind!r} (one of {', '.join(KINDS)})")
        if not isinstance(self.spec, str):
            _bad("structured output spec must be a string")
        if len(self.spec) > MAX_SPEC_CHARS:
            _bad(f"structured output spec is {len(self.spec)} characters, more than {MAX_SPEC_CHARS}")
        if self.kind == "json_object":
            if self.spec:
                _bad("json_object takes no spec")
        elif not self.spec:
            _bad(f"{self.kind} needs a non-empty spec")
        elif self.kind == "json":
            schema = _load(self.spec, "JSON schema")
            if not isinstance(schema, (dict, bool)):
                _bad("a JSON schema is an object (or a boolean)")
            _check_repetitions(_schema_counts(schema))
        elif self.kind in ("regex", "grammar"):
            _check_repetitions(_text_counts(self.spec))
        elif self.kind == "choice":
            options = _load(self.spec, "choice list")
            if (not isinstance(options, list) or not (1 <= len(options) <= MAX_CHOICES)
                    or not all(isinstance(o, str) and o for o in options)):
                _bad(f"choice needs 1 to {MAX_CHOICES} non-empty strings")
        elif self.kind == "tagged_json":
            _check_repetitions(_schema_counts([t.schema for t in TaggedJSON.from_spec(self.spec).tags]))

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached under."""
        return self.kind, self.spec

    # -- constructors (canonical specs) -------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "StructuredOutput":
        if isinstance(schema, str):
            schema = _load(schema, "JSON schema")
        return cls("json", _compact(schema))

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "StructuredOutput":
        if isinstance(options, str) or not isinstance(options, Sequence):
            _bad("choice needs a list of strings")
        return cls("choice", _compact(list(options)))

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredOutput":
        return cls("grammar", ebnf)

    @classmethod
    def tagged(cls, tagged: TaggedJSON) -> "StructuredOutput":
        return cls("tagged_json", tagged.to_spec())

    # -- parsed views -------------------------------------------------------------------------------
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.spec)

    def tagged_json(self) -> TaggedJSON:
        assert self.kind == "tagged_json"
        return TaggedJSON.from_spec(self.spec)
