"""Tool-call parsers: each format's calls and content, non-streamed and streamed in every chunking
(one character at a time, random pieces), the streamed deltas reassembled equal to the non-streamed
parse, in OpenAI's delta shape; text that is no call stays content, verbatim."""

import itertools
import json
import random

import pytest

from router.openai.tool_parsers import (TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                        ToolParser, get_tool_parser, reassemble)

ARGS = {"city": "Paris, \"FR\"", "days": [1, 2, {"deep": "}]"}], "unit": None, "ok": True, "x": -1.5e3}
ARGS_TEXT = json.dumps(ARGS)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# (parser, text, expected content, expected [(name, arguments dict)])
CASES = [
    (HermesToolParser, f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS_TEXT}}}\n</tool_call>',
     "Let me look.\n", [("get_weather", ARGS)]),
    (HermesToolParser, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                       '{"arguments": {"q": "<tool_call>"}, "name": "b"}\n</tool_call>\n\nDone!  \n',
     "Done!", [("a", {}), ("b", {"q": "<tool_call>"})]),
    (HermesToolParser, "No tools here, just a < and <tool and <tool_cal.", "No tools here, just a < and <tool and <tool_cal.", []),
    (HermesToolParser, "<tool_call>\nnot json at all</tool_call> after", "<tool_call>\nnot json at all</tool_call> after", []),
    (HermesToolParser, '<tool_call>{"name": "cut", "arguments": {"a": [1, 2', None, [("cut", None)]),  # max_tokens
    (HermesToolParser, '<tool_call>{"name": "s", "arguments": "{\\"k\\": 1}"}</tool_call>', None, [("s", {"k": 1})]),
    (Llama3JsonToolParser, f'{{"name": "get_weather", "parameters": {ARGS_TEXT}}}', None, [("get_weather", ARGS)]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     None, [("a", {"x": 1}), ("b", {})]),
    (Llama3JsonToolParser, '  \n{"name": "a", "parameters": {"x": 1}}\n{"name": "b", "parameters": {"y": [2]}} ;',
     None, [("a", {"x": 1}), ("b", {"y": [2]})]),
    (Llama3JsonToolParser, "The answer is {42}.", "The answer is {42}.", []),
    (Llama3JsonToolParser, '{"answer": 42, "why": "no name key"}', '{"answer": 42, "why": "no name key"}', []),
    (Llama3JsonToolParser, "<|python_ta", "<|python_ta", []),
    (MistralToolParser, f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS_TEXT}}}, '
                        '{"name": "b", "arguments": {"z": "]"}}]', "Sure. ", [("get_weather", ARGS), ("b", {"z": "]"})]),
    (MistralToolParser, '[TOOL_CALLS] [ {"name": "a", "arguments": {"n": 3}} ]', None, [("a", {"n": 3})]),
    (MistralToolParser, "I cannot [TOOL_CALLS] now, sorry.", "I cannot [TOOL_CALLS] now, sorry.", []),
    (MistralToolParser, "Plain [TOOL_CALL] text [TOOL", "Plain [TOOL_CALL] text [TOOL", []),
]


def check_calls(parsed, content, calls):
    assert parsed.content == content
    assert [c.function.name for c in parsed.tool_calls] == [n for n, _ in calls]
    for c, (_, args) in zip(parsed.tool_calls, calls):
        if args is None:
            assert c.function.arguments.startswith("{")  # cut short: what came, as it came
        else:
            assert json.loads(c.function.arguments) == args
    assert [c.id for c in parsed.tool_calls] == [f"call_{i}" for i in range(len(calls))]


def stream(cls: type[ToolParser], pieces):
    p = cls(ids())
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    return p, "".join(d.content for d in deltas), [c for d in deltas for c in d.tool_calls]


def chunkings(text):
    yield [text]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=lambda x: x.name if isinstance(x, type) else None)
def test_non_streamed_parse(cls, text, content, calls):
    check_calls(cls.parse(text, ids()), content, calls)


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=lambda x: x.name if isinstance(x, type) else None)
def test_streamed_deltas_reassemble_to_the_non_streamed_parse(cls, text, content, calls):
    whole = cls.parse(text, ids())
    for pieces in chunkings(text):
        p, got_content, deltas = stream(cls, pieces)
        assert got_content == (whole.content or ""), pieces
        assert reassemble(deltas) == whole.tool_calls, pieces
        assert p.called == bool(calls)
        seen = set()
        for d in deltas:  # OpenAI's shape: the first delta of a call names it, the rest add arguments
            o = d.to_openai()
            if d.index not in seen:
                seen.add(d.index)
                assert o["id"] and o["type"] == "function" and o["function"]["name"] and o["function"]["arguments"] == ""
            else:
                assert "id" not in o and "name" not in o["function"] and o["function"]["arguments"]
        assert sorted(seen) == list(range(len(calls)))


def test_arguments_stream_as_they_come():
    """Arguments are not held back to the end of the call: each piece of them goes out when it comes."""
    p = HermesToolParser(ids())
    p.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    d = p.feed('"hel')
    assert [c.arguments for c in d.tool_calls] == ['"hel']
    assert [c.arguments for c in p.feed('lo"}}\n</tool_call>').tool_calls] == ['lo"}']


def test_registry_and_ids():
    assert set(TOOL_PARSERS) == {"llama3_json", "hermes", "mistral"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="llama3_json"):
        get_tool_parser("nope")
    (call,) = MistralToolParser.parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]').tool_calls
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates check this
    (call,) = HermesToolParser.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls
    assert call.id.startswith("call_") and call.to_openai()["function"] == {"name": "f", "arguments": "{}"}
