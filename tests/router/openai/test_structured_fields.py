"""The structured-output fields of a request body -> the one constraint it carries (or a 400 naming
the field): response_format, vLLM's guided_* and structured_outputs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.errors import InvalidRequestError
from cluster.structured import StructuredOutput
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.structured_fields import constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _body(**kw):
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **kw})


@pytest.mark.parametrize("fields,output,param", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput.json_object(), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutput.json_schema(SCHEMA), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, StructuredOutput.json_schema(True),
     "response_format"),
    ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA), "guided_json"),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
     StructuredOutput.json_schema(SCHEMA), "guided_json"),  # its text: the same canonical spec
    ({"guided_regex": "[a-z]+"}, StructuredOutput.regex("[a-z]+"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"]), "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput.grammar('root ::= "a"'), "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json_schema(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput.regex("a+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput.choice(["x"]), "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "b"'}}, StructuredOutput.grammar('root ::= "b"'),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput.json_object(), "structured_outputs.json_object"),
])
def test_each_field_gives_its_constraint(fields, output, param):
    for body in (_body(**fields), ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})):
        body.check_unsupported()
        c = constraint(body)
        assert c.output == output and c.param == param


def test_no_constraint():
    assert constraint(_body()) is None
    assert constraint(_body(response_format={"type": "text"})) is None
    assert constraint(_body(response_format=None, guided_json=None)) is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"), ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"), ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"structured_outputs": {"choice": ["", "a"]}}, "structured_outputs.choice"),
])
def test_conflicting_or_empty_constraints_are_400_naming_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        constraint(_body(**fields))
    assert e.value.param == param


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema"}},  # no json_schema
    {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": "structural_tag"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "schemas": {}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},  # no name
    {"response_format": "json"}, {"guided_regex": 5}, {"guided_choice": "yes"},
    {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},  # vLLM keys we do not serve: named
    {"structured_outputs": {"structural_tag": "{}"}},
    {"guided_json": {"enum": ["a\ud800"]}}, {"structured_outputs": {"json": {"\udfff": 1}}},  # invalid Unicode
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [{"k": "\ud800"}]}}}},
])
def test_malformed_fields_are_validation_errors(fields):
    with pytest.raises(ValidationError) as e:
        _body(**fields)
    assert e.value.errors()[0]["loc"][0] in fields
