"""Forced tool calls (forced_json.py) on the engine with the random-weight demo model, which obeys the
grammar and nothing else: a named tool_choice writes one arguments object and the reply ends the
token after it closes (only EOS is allowed there); "required" writes an array of calls that the same
module's parser reads back, one call and then the end with parallel_tool_calls false; every call
names a tool and its arguments validate against the tool's parameters."""

import json

import pytest

from cluster.engine.engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.sampling.sampling_params import SamplingParams
from router.openai.tool_parsers import FunctionTool
from router.openai.tool_parsers.forced_json import (NamedCallParser, RequiredCallsParser, named_call_schema, named_tool,
                                                    required_calls_schema)

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [
    FunctionTool.from_openai({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}),
    FunctionTool.from_openai({"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}}),
]
SCHEMAS = {t.name: t.parameters for t in TOOLS}
SAMPLING = ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, dtype="float32")


def _generate(engine, so, max_tokens=160):
    params = [SamplingParams(max_tokens=max_tokens, structured=so, temperature=t, seed=s) for t, s in SAMPLING]
    return engine.generate(["What is the weather in Paris?"] * len(params), params)


def _ends_at_the_close(engine, out) -> None:
    """The reply stopped at the first token the grammar allowed it to: EOS, right after the JSON value
    closed (its text is one JSON value and nothing else)."""
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.arch.eos_token_ids, out
    json.loads(out.text)


def test_a_named_call_is_its_arguments_and_ends_when_they_close(engine):
    tool = named_tool(TOOLS, "add")
    for out in _generate(engine, named_call_schema(tool)):
        _ends_at_the_close(engine, out)
        calls = NamedCallParser(tool.name).parse_all(out.text).tool_calls
        assert [c.function.name for c in calls] == ["add"]
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["add"])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_are_an_array_that_ends_when_it_closes(engine, parallel):
    for out in _generate(engine, required_calls_schema(TOOLS, parallel)):
        parsed = RequiredCallsParser().parse_all(out.text)
        assert parsed.tool_calls and parsed.content is None, out.text
        calls = parsed.tool_calls
        if parallel and out.finish_reason == "length":
            calls = calls[:-1]  # random weights may call on and on: the last call is cut short
        else:
            _ends_at_the_close(engine, out)
            assert len(calls) == len(json.loads(out.text))
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_refusals_name_tool_choice():
    with pytest.raises(InvalidRequestError, match="not among the tools") as e:
        named_tool(TOOLS, "nope")
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="needs tools") as e:
        required_calls_schema([], True)
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        FunctionTool.from_openai({"type": "function", "function": {"name": "bad name!"}})
    assert FunctionTool.from_openai({"type": "function", "function": {"name": "f"}}).parameters is None
