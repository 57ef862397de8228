"""Forced tool calls on a server without --tool-call-parser (as vLLM serves them by default), through
real HTTP with the official `openai` client on the real workers (`real_pd_cluster`) and the
random-weight demo model, which obeys the grammar and nothing else: a named tool_choice comes back
as one call of that function whose arguments validate against its schema, and "required" as one or
more calls of the tools (one with parallel_tool_calls false), each ending "tool_calls" when its JSON
closes, within max_tokens 64, streamed equal to the whole response. A tool_choice naming no tool, or
forcing a call without tools, is a 400 in OpenAI's error shape naming tool_choice."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "pdserve-demo"
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
           "required": ["unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next days, and the time there?"}]


def _client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(client, **kw):
    calls: dict[int, list] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for d in choice.delta.tool_calls or ():
            c = calls.setdefault(d.index, [None, ""])
            c[0] = d.function.name or c[0]
            c[1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice,parallel,finish", [
    ({"type": "function", "function": {"name": "get_weather"}}, None, "tool_calls"),
    ("required", False, "tool_calls"),
    # Parallel calls: random weights may write calls until max_tokens ("length"); every one complete
    # validates, and a call cut before its name is neither a call nor content.
    ("required", None, None),
])
def test_forced_calls_follow_the_tools_schemas(real_pd_cluster, choice, parallel, finish):
    client = _client(real_pd_cluster)
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=64, temperature=0)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    out = client.chat.completions.create(**kw)
    c = out.choices[0]
    assert c.finish_reason == (finish or c.finish_reason) and c.finish_reason in ("stop", "tool_calls", "length"), c
    finish = c.finish_reason
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert calls and not c.message.content and all(t.id and t.type == "function" for t in c.message.tool_calls)
    complete = calls if finish != "length" else calls[:-1]  # the last may be cut
    for name, args in complete:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["get_weather"]
    if parallel is False:
        assert len(calls) == 1
    assert _streamed(client, **kw) == (calls, finish)


@pytest.mark.parametrize("kw", [
    dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_stock_price"}}),
    dict(tool_choice="required"),
    dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
])
def test_a_forced_call_that_cannot_be_made_is_a_400(real_pd_cluster, kw):
    with pytest.raises(openai.BadRequestError) as e:
        _client(real_pd_cluster).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == "tool_choice"
    assert "tool" in err["message"], err
