"""tool_choice "required" and a named function: each parser's grammar, enforced by the engine on the
random-weight demo model, yields calls that the same parser reads back, with arguments that validate
against the tool's parameters; the grammar is refused for a name that is not a tool."""

import json

import pytest

from cluster.engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.sampling_params import SamplingParams
from router.openai.tool_parsers import TOOL_PARSERS, FunctionTool

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


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, dtype="float32")


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_required_and_named_calls_are_valid_calls(engine, name):
    parser = TOOL_PARSERS[name]
    choices = [("required", True), ("required", False), ({"type": "function", "function": {"name": "add"}}, True)]
    for choice, parallel in choices:
        so = parser.constraint(TOOLS, choice, parallel)
        params = [SamplingParams(max_tokens=160, structured=so, temperature=t, seed=s)
                  for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))]
        for out in engine.generate(["What is the weather in Paris?"] * len(params), params):
            parsed = parser.parse(out.text)
            assert parsed.tool_calls and parsed.content is None, (name, choice, out.text)
            calls = parsed.tool_calls
            if parallel and out.finish_reason == "length":
                calls = calls[:-1]  # a random model may call on and on: the last call is cut short
            else:
                assert out.finish_reason == "stop", (name, choice, out.text)
            assert parallel or len(calls) == 1
            for call in calls:
                if isinstance(choice, dict):
                    assert call.function.name == "add"
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_constraint_refusals():
    parser = TOOL_PARSERS["hermes"]
    with pytest.raises(InvalidRequestError) as e:
        parser.constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        parser.constraint([], "required")
    with pytest.raises(InvalidRequestError):
        parser.constraint(TOOLS, "sometimes")
    with pytest.raises(InvalidRequestError):
        FunctionTool.from_openai({"type": "function", "function": {"name": "bad name!"}})
    assert FunctionTool.from_openai({"type": "function", "function": {"name": "f"}}).parameters is None
