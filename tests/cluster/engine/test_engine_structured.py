"""Structured output through the in-process engine, on the random-weight demo model: whatever it
would say, every output matches its JSON schema, regex or choice (greedy and seeded sampling, with and
without logits processing); a bad schema is refused before anything is admitted; prompt scoring
(max_tokens 0) returns the prompt's logprobs and no token."""

import json
import re

import pytest

from cluster.engine.engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.sampling.sampling_params import SamplingParams
from cluster.structured import StructuredOutput

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                           "geo": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90,
                                                                            "maximum": 90}}, "required": ["lat"]}},
            "required": ["city", "zip", "geo"],
        },
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                   "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
}
PROMPTS = ["Describe the user as JSON:", "Once upon a time", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, dtype="float32", num_blocks=512)


def _sampling():
    yield dict(temperature=0.0)
    for seed in range(4):
        yield dict(temperature=1.0, seed=seed)
    yield dict(temperature=0.9, top_p=0.9, top_k=50, seed=11)
    yield dict(temperature=1.0, seed=5, logprobs=2, repetition_penalty=1.3)  # the features path


def test_json_schema_output_always_validates(engine):
    so = StructuredOutput.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=400, structured=so, **kw) for kw in _sampling()]
    outs = engine.generate([p for p in PROMPTS for _ in params], [sp for _ in PROMPTS for sp in params])
    for o in outs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > len(PROMPTS)  # seeds do change the answer
    assert engine.grammars.compiles == 1  # one schema, compiled once


def test_regex_choice_grammar_and_json_object(engine):
    regex = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)"
    cases = [(StructuredOutput.regex(regex), lambda t: re.fullmatch(regex, t)),
             (StructuredOutput.choice(["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
             (StructuredOutput.grammar('root ::= "(" [0-9]{1,4} (" + " [0-9]{1,4})? ")"'),
              lambda t: re.fullmatch(r"\([0-9]{1,4}( \+ [0-9]{1,4})?\)", t)),
             (StructuredOutput.json_object(), lambda t: isinstance(json.loads(t), dict))]
    for so, ok in cases:
        params = [SamplingParams(max_tokens=120, structured=so, **kw) for kw in _sampling()]
        outs = engine.generate(PROMPTS[:2] * len(params), params * 2)
        for o in outs:
            if so.kind == "json_object" and o.finish_reason == "length":
                continue  # any object may be longer than max_tokens; the others end by construction
            assert o.finish_reason == "stop" and ok(o.text), (so.kind, o)


def test_constrained_and_free_requests_share_batches(engine):
    so = StructuredOutput.choice(["alpha", "beta"])
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate([PROMPTS[1]], free)[0]
    mixed = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]],
                            [free, SamplingParams(max_tokens=20, temperature=0.0, structured=so), free])
    assert mixed[0].token_ids == mixed[2].token_ids == alone.token_ids  # unconstrained rows: unchanged
    assert mixed[1].text in ("alpha", "beta")


def test_an_invalid_constraint_is_refused_before_admission(engine):
    for so in (StructuredOutput("json", '{"type": "nonsense"}'), StructuredOutput.regex("(unclosed"),
               StructuredOutput.grammar("root ::= missing_rule")):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("hello", SamplingParams(structured=so))
        assert e.value.param == "structured_output"
    assert not engine.has_work()


def test_prompt_scoring_returns_prompt_logprobs_and_no_token(engine):
    prompt = "The quick brown fox jumps over the lazy dog"
    scored = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    ref = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert scored.token_ids == () and scored.text == "" and scored.finish_reason == "length"
    assert scored.prompt_logprobs == ref.prompt_logprobs and len(scored.prompt_logprobs) == len(ref.prompt_token_ids)
    assert scored.prompt_logprobs[0] is None and all(lp is not None for lp in scored.prompt_logprobs[1:])
