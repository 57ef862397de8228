"""Tool calling through real HTTP with the official `openai` client, once per tool-call format: a
cluster (real decode worker) serving the demo model with that family's chat template
(tool_chat_templates.py) and `--tool-call-parser` set to it, `--enable-auto-tool-choice` on.

On the random-weight model a call only happens when the grammar forces it, so "required" and named
tool_choice carry the checks: every call names a tool and its arguments validate against the tool's
parameters; parallel_tool_calls false (and a named function) yields exactly one call;
finish_reason is "tool_calls"; the streamed deltas (index, id, type and name, then argument
fragments) reassemble to the non-streamed call, greedy and seeded. "auto" is served and its stream
equals its whole reply too; a conversation with earlier calls and tool results renders and is served.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from tool_chat_templates import with_template

import serving_harness

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = serving_harness.MODEL
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
SAMPLING = [dict(temperature=0.0), dict(temperature=1.0, seed=3)]


@pytest.fixture(scope="module", params=["llama3_json", "hermes", "mistral"])
def tool_cluster(request, ray_session, demo_model_dir, tmp_path_factory):
    pytest.importorskip("decode_worker.actor")
    parser = request.param
    model = with_template(demo_model_dir, tmp_path_factory.mktemp(f"tools-{parser}"), parser)
    sc = serving_harness.start_cluster(model, prefill_workers=0, decode_workers=1, tool_call_parser=parser,
                                       enable_auto_tool_choice=True)
    sc.parser = parser
    yield sc
    sc.shutdown()


def _client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=180)


def _whole(client, **kw):
    r = client.chat.completions.create(model=MODEL, **kw)
    m = r.choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    assert all(c.type == "function" for c in m.tool_calls or ())
    return m.content, calls, r.choices[0].finish_reason


def _streamed(client, **kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or ():
            c = calls.setdefault(d.index, [None, None, ""])
            if d.id is not None:  # a call's first delta: id, type and name, before any argument
                assert c == [None, None, ""] and d.type == "function" and d.function.name
                c[0], c[1] = d.id, d.function.name
            c[2] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return content or None, [tuple(c) for _, c in sorted(calls.items())], finish


def _same_calls(a, b):
    """Equal but for the ids (each response makes its own)."""
    return [(n, args) for _, n, args in a] == [(n, args) for _, n, args in b]


def _check_call(parser, call):
    call_id, name, args = call
    assert name in SCHEMAS
    jsonschema.validate(json.loads(args), SCHEMAS[name])
    assert re.fullmatch(r"[A-Za-z0-9]{9}" if parser == "mistral" else r"call_[0-9a-f]{24}", call_id)


def test_forced_calls_are_valid_and_stream_as_they_are_whole(tool_cluster):
    client = _client(tool_cluster)
    named = {"type": "function", "function": {"name": "add"}}
    cases = []
    for choice, parallel in (("required", False), ("required", True), (named, True)):
        for kw in SAMPLING:
            cases.append((choice, parallel, kw))

    def run(choice, parallel, kw):
        req = dict(messages=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=160,
                   **kw)
        return _whole(client, **req), _streamed(client, **req)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: run(*c), cases))
    for (choice, parallel, kw), (whole, streamed) in zip(cases, results):
        content, calls, finish = whole
        assert calls and content is None, (tool_cluster.parser, choice, whole)
        assert streamed[0] is None and _same_calls(streamed[1], calls) and streamed[2] == finish
        if parallel and choice == "required" and finish == "length":
            calls = calls[:-1]  # a random model may call on and on: the last call is cut short
        else:
            assert finish == "tool_calls", whole
        if not parallel or isinstance(choice, dict):
            assert len(calls) == 1
        for call in calls + streamed[1][: len(calls)]:
            _check_call(tool_cluster.parser, call)
            if isinstance(choice, dict):
                assert call[1] == "add"


def test_auto_streams_as_it_is_whole(tool_cluster):
    client = _client(tool_cluster)
    req = dict(messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0.0)  # tool_choice: auto by default
    content, calls, finish = _whole(client, **req)
    s_content, s_calls, s_finish = _streamed(client, **req)
    assert (s_content, s_finish) == (content, finish) and _same_calls(s_calls, calls)
    assert finish == ("tool_calls" if calls else finish) and finish in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0.0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_tool_results(tool_cluster):
    client = _client(tool_cluster)
    call_id = "abcDEF123"
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]
    content, calls, finish = _whole(client, messages=messages, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "add"}}, max_tokens=80, temperature=0.0)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0][1] == "add"
    _check_call(tool_cluster.parser, calls[0])
    # The rendered prompt carries the call and the result (the prompt is longer than without them).
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=1)
    long = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1)
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + 10


def test_tool_refusals(tool_cluster):
    client = _client(tool_cluster)
    for kw, param in ((dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
                      (dict(tools=[{"type": "function", "function": {"name": "x", "parameters": {
                          "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}], tool_choice="required"),
                       "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **{"tools": TOOLS, **kw})
        assert e.value.body["param"] == param, e.value.body


def test_the_sdks_pydantic_function_tool(tool_cluster):
    """`openai.pydantic_function_tool(Model)` (a strict tool) through `chat.completions.parse`: a forced
    call's arguments come back parsed into the model; with tool_choice "auto" a strict tool is a 400
    naming tools (no grammar writes an auto call, so strictness cannot be promised there)."""
    from pydantic import BaseModel, Field

    class Add(BaseModel):
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    client = _client(tool_cluster)
    tool = openai.pydantic_function_tool(Add)
    assert tool["function"]["strict"] is True
    r = client.chat.completions.parse(model=MODEL, messages=QUESTION, tools=[tool], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=160, temperature=0.0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0].function
    assert call.name == "Add" and isinstance(call.parsed_arguments, Add)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[tool], max_tokens=4)
    assert e.value.body["param"] == "tools" and "strict" in e.value.body["message"]
