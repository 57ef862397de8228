"""The structured-output fields of a request body, as the one constraint its generation carries.

    response_format        {type: text | json_object | json_schema {name, schema, strict}} (OpenAI)
    guided_json            a JSON schema (or its text)                                      (vLLM)
    guided_regex           a regular expression                                             (vLLM)
    guided_choice          a list of strings: the output is one of them                     (vLLM)
    guided_grammar         an EBNF grammar                                                  (vLLM)
    structured_outputs     {json | regex | choice | grammar | json_object}: vLLM's newer spelling

At most one constraint per request (a second is a 400 naming it); `response_format: {type: text}`
asks for none. `constraint(body)` returns it with the field it came from, which a bad schema, regex or
grammar is named by in its 400 (the grammar engine's check, `Gateway.check_constraint`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import InvalidRequestError
from cluster.structured import StructuredOutput
from router.openai.protocol import StructuredOutputsParams


@dataclass(frozen=True)
class Constraint:
    """A request's structured output and the HTTP field that asked for it."""

    output: StructuredOutput
    param: str


def _from_structured_outputs(so: StructuredOutputsParams) -> list[tuple[StructuredOutput, str]]:
    found = []
    if so.json_ is not None:
        found.append(_build("structured_outputs.json", lambda: StructuredOutput.json_schema(so.json_)))
    if so.regex is not None:
        found.append(_build("structured_outputs.regex", lambda: StructuredOutput.regex(so.regex)))
    if so.choice is not None:
        found.append(_build("structured_outputs.choice", lambda: StructuredOutput.choice(so.choice)))
    if so.grammar is not None:
        found.append(_build("structured_outputs.grammar", lambda: StructuredOutput.grammar(so.grammar)))
    if so.json_object:
        found.append((StructuredOutput.json_object(), "structured_outputs.json_object"))
    return found


def _build(param: str, make) -> tuple[StructuredOutput, str]:
    try:
        return make(), param
    except InvalidRequestError as e:  # the spec's own shape (empty, too large, not JSON ...)
        raise InvalidRequestError(str(e), param) from None


def constraint(body) -> Constraint | None:
    """The body's one structured-output constraint, or None."""
    found: list[tuple[StructuredOutput, str]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutput.json_object(), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        found.append(_build("response_format", lambda: StructuredOutput.json_schema(True if schema is None
                                                                                       else schema)))
    if body.guided_json is not None:
        found.append(_build("guided_json", lambda: StructuredOutput.json_schema(body.guided_json)))
    if body.guided_regex is not None:
        found.append(_build("guided_regex", lambda: StructuredOutput.regex(body.guided_regex)))
    if body.guided_choice is not None:
        found.append(_build("guided_choice", lambda: StructuredOutput.choice(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(_build("guided_grammar", lambda: StructuredOutput.grammar(body.guided_grammar)))
    if body.structured_outputs is not None:
        inner = _from_structured_outputs(body.structured_outputs)
        if not inner:
            raise InvalidRequestError("structured_outputs names no constraint (json, regex, choice, grammar or "
                                      "json_object)", "structured_outputs")
        found.extend(inner)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise InvalidRequestError(f"give at most one structured output constraint, got {names}", found[1][1])
    return Constraint(*found[0])
