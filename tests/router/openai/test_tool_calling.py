"""A chat request's tools at the gateway, without a cluster: which tool_choice the server serves (and
the 400s naming the field), the forced-call constraint, the chat template rendering tools, calls and
results in each family's format, and a reply's text -> OpenAI tool calls, streamed chunk by chunk
(as the chat endpoint frames them) and whole, equal to each other in every format, special-token
tags included (auto mode keeps them in the text)."""

from __future__ import annotations

import json
import random
import re

import pytest
from pydantic import ValidationError
from tool_chat_templates import TEMPLATES

from cluster.errors import InvalidRequestError
from cluster.text.tokenizer import encode_chat
from router.openai.protocol import ChatCompletionRequest
from router.openai.serving_chat import _ChatChunks
from router.openai.tool_calling import ToolCalling
from router.openai.tool_parsers import TOOL_PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**kw) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})
    body.check_unsupported()
    return body


def test_which_tool_choice_is_served():
    assert ToolCalling.of(chat(), "hermes", True) is None
    tc = ToolCalling.of(chat(tools=[WEATHER, TIME]), "hermes", True)  # tools without tool_choice: auto
    assert tc.choice == "auto" and tc.parses and tc.constraint is None and tc.max_calls is None
    assert tc.template_tools[1] == {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    none = ToolCalling.of(chat(tools=[WEATHER], tool_choice="none"), None, False)
    assert none.choice == "none" and not none.parses and none.template_tools[0] == WEATHER
    req = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice="required"), "mistral", False)
    assert req.choice == "required" and req.constraint.kind == "json" and "maxItems" not in req.constraint.spec
    call = req.parse('[{"name": "get_time", "parameters": {}}]')[1][0]  # the format's ids, vLLM's JSON
    assert call.function.name == "get_time" and re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    one = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), "hermes",
                         False)
    assert one.max_calls == 1 and json.loads(one.constraint.spec)["maxItems"] == 1
    named = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                           "llama3_json", False)
    assert named.choice == "function" and json.loads(named.constraint.spec) == {"type": "object"}
    assert ToolCalling.of(chat(tools=[WEATHER], parallel_tool_calls=False), "hermes", True).max_calls == 1
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    forced = ToolCalling.of(chat(tools=[strict], tool_choice="required"), "hermes", False)  # the grammar keeps it
    assert json.loads(forced.constraint.spec)["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER[
        "function"]["parameters"]
    assert ToolCalling.of(chat(tools=[strict], tool_choice="none"), None, False).choice == "none"  # no call: no promise


@pytest.mark.parametrize("kw,parser,auto,param,match", [
    ({"tool_choice": "required"}, "hermes", True, "tool_choice", "needs tools"),
    ({"tool_choice": "required"}, None, False, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, None, False, "tool_choice",
     "needs tools"),
    ({"tools": [WEATHER]}, "hermes", False, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER]}, None, False, "tool_choice", "--tool-call-parser"),
    ({"tools": [WEATHER]}, None, True, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "hermes", True,
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, False,
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "hermes", True, "tools", "twice"),
    # "auto" has no grammar: strict arguments cannot be promised there.
    ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]}, "hermes", True, "tools",
     "enforced only when tool_choice forces a call"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "hermes", True, "tools", "letters"),
])
def test_tool_refusals_name_the_field(kw, parser, auto, param, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        ToolCalling.of(chat(**kw), parser, auto)
    assert e.value.param == param


@pytest.mark.parametrize("kw", [
    {"tools": []}, {"tools": [{"type": "retrieval"}]}, {"tool_choice": "sometimes"},
    {"tool_choice": {"type": "function"}}, {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
    {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
    {"messages": [{"role": "assistant", "content": "x", "tool_call_id": "a"}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]},  # no arguments
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x\ud800": {}}}}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": [["\udc00"]]}}}]},
])
def test_malformed_tool_fields_are_validation_errors(kw):
    with pytest.raises(ValidationError):
        chat(**kw)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 C"},
    {"role": "user", "content": "And the time?"},
]


@pytest.mark.parametrize("parser", sorted(TEMPLATES))
def test_family_templates_render_tools_calls_and_results(demo_model_dir, parser):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    tok.chat_template = TEMPLATES[parser]
    body = chat(messages=CONVERSATION, tools=[WEATHER, TIME])
    msgs = [m.as_template_dict() for m in body.messages]
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object for `| tojson`
    assert msgs[3] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "abcDEF123"}
    tools = list(ToolCalling.of(body, parser, True).template_tools)
    text = tok.decode(encode_chat(tok, msgs, tools))
    assert '"get_weather"' in text and '"get_time"' in text and "Weather now" in text  # the tools
    assert '{"city": "Paris"}' in text and "sunny, 21 C" in text  # the call and its result
    after_result = tok.decode(encode_chat(tok, msgs[:-1], tools))  # the turn after a tool's result
    assert '"get_time"' in after_result and "sunny, 21 C" in after_result
    if parser == "mistral":
        assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]' in text
    assert encode_chat(tok, msgs) != encode_chat(tok, msgs, tools)  # without tools: none rendered


def _stream(tc: ToolCalling, body, pieces: list[str], finish: str) -> list[dict]:
    fmt = _ChatChunks("id", body, tc, 0)
    events = []
    for i, p in enumerate(pieces):
        ev = fmt.piece(0, p, finish if i == len(pieces) - 1 else None, [])
        assert ev.startswith("data: ")
        events.append(json.loads(ev[6:])["choices"][0])
    return events


def _reassembled(events):
    content = "".join(e["delta"].get("content") or "" for e in events)
    calls: dict[int, dict] = {}
    for e in events:
        for d in e["delta"].get("tool_calls") or ():
            c = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert d["type"] == "function" and d["function"]["name"] and c["id"] is None
                c["id"], c["name"] = d["id"], d["function"]["name"]
            c["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


REPLIES = {
    "llama3_json": ['<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}', "Just text, {not a call}."],
    "hermes": ['Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "No call <tool here."],
    "mistral": ['Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', "Nothing [TOOL to call."],
}


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_streamed_tool_calls_reassemble_to_the_whole_reply(parser):
    rng = random.Random(7)
    for parallel in (True, False):
        body = chat(tools=[WEATHER, TIME], parallel_tool_calls=parallel)
        tc = ToolCalling.of(body, parser, True)
        for reply in REPLIES[parser]:
            content, calls = tc.parse(reply)
            whole = [(c.function.name, c.function.arguments) for c in calls]
            if calls:
                assert [n for n, _ in whole] == (["get_weather", "get_time"] if parallel else ["get_weather"])
                assert json.loads(whole[0][1]) == {"city": "Paris"}
            else:
                assert content == reply
            for _ in range(5):  # random chunkings, one character at a time among them
                cuts = sorted(rng.sample(range(1, len(reply)), rng.randint(0, len(reply) - 1)))
                pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
                events = _stream(tc, body, pieces, "stop")
                assert _reassembled(events) == ((content or ""), whole)
                assert events[-1]["finish_reason"] == ("tool_calls" if calls else "stop")
                assert all(e["finish_reason"] is None for e in events[:-1])
            cut = _stream(tc, body, [reply], "length")  # cut by max_tokens: not a finished call
            assert cut[-1]["finish_reason"] == "length"


def test_without_parsing_the_reply_is_content():
    body = chat(tools=[WEATHER], tool_choice="none")
    events = _stream(ToolCalling.of(body, "hermes", True), body, ['<tool_call>\n{"name": "get_weather", ', "}"], "stop")
    assert _reassembled(events) == ('<tool_call>\n{"name": "get_weather", }', []) and events[-1]["finish_reason"] == "stop"


def test_every_parser_has_a_template():
    assert set(TEMPLATES) == set(TOOL_PARSERS)


def test_call_arguments_render_as_an_object_when_they_are_one():
    def rendered(arguments):
        body = chat(messages=[{"role": "assistant", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": arguments}}]}])
        return body.messages[0].as_template_dict()["tool_calls"][0]["function"]["arguments"]

    assert rendered('{"x": [1]}') == {"x": [1]}
    assert rendered("[1, 2]") == "[1, 2]" and rendered("{cut") == "{cut"
    assert rendered('{"x": "\\ud800"}') == '{"x": "\\ud800"}'  # would decode to a lone surrogate: kept as text


def test_forced_calls_are_vllms_json_with_or_without_a_parser():
    """A named tool_choice is its arguments object under the function's schema, "required" an array of
    {name, parameters} under an anyOf of the tools' (vLLM's _get_json_schema_from_tool), one element
    with parallel_tool_calls false: the same grammar with any --tool-call-parser or none (a format's
    tagged calls cost the wrapper's tokens and have no end of their own)."""
    for parser in (None, *sorted(TOOL_PARSERS)):
        named = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
            "name": "get_weather"}}), parser, False)
        assert named.choice == "function" and named.constraint.kind == "json" and named.max_calls == 1
        assert json.loads(named.constraint.spec) == WEATHER["function"]["parameters"]
        req = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice="required"), parser, False)
        schema = json.loads(req.constraint.spec)
        assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
        assert [s["properties"]["name"] for s in schema["items"]["anyOf"]] == [
            {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]}]
        assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
        one = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), parser,
                             False)
        assert json.loads(one.constraint.spec)["maxItems"] == 1 and one.max_calls == 1


@pytest.mark.parametrize("choice,text,calls,finish", [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Par\\"is"}',
     [("get_weather", '{"city": "Par\\"is"}')], "tool_calls"),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], "tool_calls"),
])
def test_forced_json_replies_stream_and_parse_the_same(choice, text, calls, finish):
    tc = ToolCalling.of(chat(tools=[WEATHER, TIME], tool_choice=choice), None, False)
    content, whole = tc.parse(text)
    assert content is None and [(c.function.name, c.function.arguments) for c in whole] == calls
    assert tc.finish_reason(bool(whole), "stop") == finish and tc.finish_reason(True, "length") == "length"
    body = chat(tools=[WEATHER, TIME], tool_choice=choice, stream=True)
    fmt = _ChatChunks("id", body, tc, 0)
    rng = random.Random(3)
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got: dict[int, list] = {}
    for k, p in enumerate(pieces):
        d = json.loads(fmt.piece(0, p, "stop" if k == len(pieces) - 1 else None, [])[6:])
        delta, end = d["choices"][0]["delta"], d["choices"][0]["finish_reason"]
        assert "content" not in delta
        for x in delta.get("tool_calls", ()):
            c = got.setdefault(x["index"], [None, ""])
            c[0] = x["function"].get("name", c[0])
            c[1] += x["function"]["arguments"]
    assert [tuple(got[i]) for i in sorted(got)] == calls and end == finish
