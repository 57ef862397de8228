"""Structured output through real HTTP with the official `openai` client, on the real prefill and
decode workers (`real_pd_cluster`: a long prompt's first token is sampled by the prefill worker, a
short one's by the decode worker's local prefill; the rest by the decode step under its grammar
mask), with the random-weight demo model, which would write anything:

- a JSON schema with nested objects, enums, arrays and required fields (response_format json_schema
  on chat and completions, guided_json, structured_outputs.json) always yields JSON that validates
  against it, greedy and sampled, streamed and not (the stream's text equals the whole response's);
- json_object, regex, choice and EBNF grammar likewise match;
- a schema, regex or grammar the engine cannot compile, or two constraints, is a 400 naming the field,
  and the cluster serves on;
- skip_special_tokens reaches the decode worker's detokenizer.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "pdserve-demo"
LONG = "Describe the user of this account as a JSON document, with every field filled in"  # > 12 tokens
SHORT = "User as JSON:"  # <= 12 tokens: the decode worker's local prefill
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "required": ["city", "zip", "geo"], "properties": {
            "city": {"type": "string", "maxLength": 8}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "geo": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                    "required": ["lat"]}}},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                   "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
}
SAMPLING = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.9, top_p=0.9, seed=2)]
MAX_TOKENS = 300  # far more than the schema's longest document


def _client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=180)


def _chat(client, prompt, stream, **kw):
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=msgs, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _completion(client, prompt, stream, **kw):
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _run_all(jobs):
    """The requests side by side (the decode worker batches them): [(key, (text, finish))]."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [(key, pool.submit(fn)) for key, fn in jobs]
        return [(key, f.result()) for key, f in futures]


def test_json_schema_output_always_validates(real_pd_cluster):
    client = _client(real_pd_cluster)
    rf = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
    jobs = []
    for prompt in (LONG, SHORT):
        for i, kw in enumerate(SAMPLING):
            for stream in (False, True):
                common = dict(max_tokens=MAX_TOKENS, **kw)
                jobs.append((("chat", prompt, i, stream),
                             lambda p=prompt, s=stream, c=common: _chat(client, p, s, response_format=rf, **c)))
                # completions: the same schema through each spelling
                field = [{"response_format": rf}, {"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}][i]
                jobs.append((("completion", prompt, i, stream),
                             lambda p=prompt, s=stream, c=common, f=field: _completion(client, p, s, extra_body=f, **c)))
    results = dict(_run_all(jobs))
    for key, (text, finish) in results.items():
        assert finish == "stop", (key, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    for (kind, prompt, i, stream), out in results.items():
        if stream:  # streamed or not, the same seeded answer
            assert out == results[(kind, prompt, i, False)], (kind, prompt, i)
    assert len({text for text, _ in results.values()}) > 4  # prompts and seeds do change the answer


def test_json_object_regex_choice_and_grammar(real_pd_cluster):
    client = _client(real_pd_cluster)
    regex = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)"
    choices = ["yes", "no", "it depends"]
    grammar = 'root ::= "(" [0-9]{1,4} (" + " [0-9]{1,4})? ")"'
    cases = {
        "regex": ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        "so_regex": ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        "choice": ({"guided_choice": choices}, lambda t: t in choices),
        "so_choice": ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        "grammar": ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"\([0-9]{1,4}( \+ [0-9]{1,4})?\)", t)),
        "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    }
    jobs = []
    for name, (field, _) in cases.items():
        for prompt in (LONG, SHORT):
            for i, kw in enumerate(SAMPLING[:2]):
                for stream in (False, True):
                    max_tokens = 400 if name == "json_object" else 60
                    jobs.append(((name, prompt, i, stream, "completion"), lambda p=prompt, s=stream, f=field, k=kw, m=max_tokens:
                                 _completion(client, p, s, max_tokens=m, extra_body=f, **k)))
                    if name in ("choice", "json_object"):
                        jobs.append(((name, prompt, i, stream, "chat"), lambda p=prompt, s=stream, f=field, k=kw, m=max_tokens:
                                     _chat(client, p, s, max_tokens=m, extra_body=f, **k)))
    for (name, *rest), (text, finish) in _run_all(jobs):
        if name == "json_object" and finish == "length":
            continue  # an object is unbounded: a random model may write one longer than max_tokens
        assert finish == "stop" and cases[name][1](text), (name, rest, text)


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                                         "maximum": 1}}}),
    ("guided_json", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    ("guided_regex", "(unclosed"),
    ("guided_grammar", "root ::= undefined_rule"),
    ("structured_outputs", {"grammar": "root ::= (((("}),
])
def test_uncompilable_constraints_are_400_naming_the_field(real_pd_cluster, field, value):
    client = _client(real_pd_cluster)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=SHORT, max_tokens=4, extra_body={field: value})
    assert e.value.body["param"].split(".")[0] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={field: value})
    assert e.value.body["param"].split(".")[0] == field
    out = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=3, extra_body={"guided_choice": ["ok"]})
    assert out.choices[0].text == "ok"  # it serves on


def test_two_constraints_are_400(real_pd_cluster):
    client = _client(real_pd_cluster)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert e.value.body["param"] == "guided_regex"


def test_skip_special_tokens_reaches_the_detokenizer(real_pd_cluster, reference_engine):
    """The only token allowed is a special one (<|im_start|>): its text is output only when asked."""
    special = reference_engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    client = _client(real_pd_cluster)
    for prompt in (LONG, SHORT):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0)
        ids = {"allowed_token_ids": [special], "ignore_eos": True}
        assert client.completions.create(**kw, extra_body=ids).choices[0].text == ""
        kept = client.completions.create(**kw, extra_body={**ids, "skip_special_tokens": False}).choices[0].text
        assert kept == "<|im_start|>" * 3
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **kw, stream=True, extra_body={**ids, "skip_special_tokens": False}))
        assert streamed == kept


def test_the_sdks_parse_helper_with_a_pydantic_model(real_pd_cluster):
    """`client.chat.completions.parse(response_format=Model)`: the SDK sends the model's strict JSON
    schema (json_schema, strict: true) and reads the reply back into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        answer: Literal["yes", "no", "maybe"]
        confident: bool
        votes: list[Literal["a", "b"]] = Field(max_length=2)

    client = _client(real_pd_cluster)
    for prompt in (LONG, SHORT):
        for kw in SAMPLING[:2]:
            r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              response_format=Verdict, max_tokens=80, **kw)
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "stop" and isinstance(m.parsed, Verdict), m
            assert m.parsed == Verdict.model_validate_json(m.content)
