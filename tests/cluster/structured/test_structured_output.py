"""StructuredOutput: shape checks, canonical specs (cache keys), and its trip through the typed
messages (msgspec, as on the gateway -> router channel; pickle, as through Ray)."""

import json
import pickle

import msgspec
import pytest

from cluster.errors import InvalidRequestError
from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.structured import JSONTag, StructuredOutput, TaggedJSON

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["b"]}


def test_constructors_give_canonical_specs_and_keys():
    a = StructuredOutput.json_schema(SCHEMA)
    b = StructuredOutput.json_schema(json.dumps(SCHEMA, indent=4))
    assert a == b and a.key == b.key == ("json", json.dumps(SCHEMA, separators=(",", ":")))
    assert list(json.loads(a.spec)["properties"]) == ["b", "a"]  # key order is the output's: kept
    assert StructuredOutput.choice(["yes", "no"]).choices() == ["yes", "no"]
    assert StructuredOutput.json_object().key == ("json_object", "")
    t = TaggedJSON("<p>", (JSONTag("<a>", {"type": "object"}, "</a>"), JSONTag("", True, "")), ", ", "</p>", True, False)
    so = StructuredOutput.tagged(t)
    assert so.tagged_json() == t


@pytest.mark.parametrize("kind,spec", [
    ("yaml", "x"), ("json", ""), ("json", "{not json"), ("json", "[1, 2]"), ("json_object", "{}"),
    ("regex", ""), ("grammar", ""), ("choice", "[]"), ("choice", '["a", 3]'), ("choice", '["", "b"]'),
    ("choice", '"ab"'), ("tagged_json", '{"tags": []}'), ("tagged_json", '{"tags": [{"begin": "a"}]}'),
    ("tagged_json", '{"tags": [{"begin": "", "schema": {}, "end": ""}], "extra": 1}'),
    ("regex", "a" * 300_000),
])
def test_malformed_specs_are_400s(kind, spec):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput(kind, spec)
    assert e.value.param == "structured_output"


def test_sampling_params_carry_it_and_check_its_type():
    so = StructuredOutput.regex("[a-z]+")
    assert SamplingParams(structured=so).structured is so
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured={"kind": "regex", "spec": "a"})


def test_max_tokens_zero_only_scores_a_prompt():
    assert SamplingParams(max_tokens=0, prompt_logprobs=1).scores_prompt_only
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("so", [StructuredOutput.json_schema(SCHEMA), StructuredOutput.choice(["a\"b", "é"]),
                                StructuredOutput.tagged(TaggedJSON("", (JSONTag("{", {"type": "object"}, "}"),)))])
def test_a_request_keeps_its_grammar_over_msgspec_and_pickle(so):
    req = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=5, structured=so), 7, 0.0, resumed_tokens=2)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GenerateRequest)
    assert wire == req and wire.params.structured == so and isinstance(wire.params.structured, StructuredOutput)
    assert pickle.loads(pickle.dumps(req)) == req


def test_a_bad_spec_is_refused_when_decoded():
    bad = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1], "seed": 1, "arrival_time": 0.0,
                                  "params": {"structured": {"kind": "json", "spec": "{oops"}}})
    with pytest.raises(InvalidRequestError):
        msgspec.msgpack.decode(bad, type=GenerateRequest)


def test_the_package_imports_no_torch_and_its_lazy_names_resolve():
    """SamplingParams carries a StructuredOutput and `pdserve serve --help` reads its module: importing
    cluster.structured must not bring torch in; the names that need it load on first use."""
    import subprocess
    import sys

    code = ("import sys, cluster.structured as s; assert 'torch' not in sys.modules, 'torch imported';"
            "from cluster.structured import GrammarCompiler, RequestGrammar, fill_bitmasks;"
            "from cluster.structured.grammar_compiler import GrammarCompiler as G; assert GrammarCompiler is G;"
            "assert 'torch' in sys.modules\n"
            "try:\n    s.NoSuchName\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')")
    # Generous: the child imports torch (~10 s of CPU), minutes at the other test stream's nice 10 on a busy machine.
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
