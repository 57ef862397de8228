"""Request validation of the OpenAI-compatible bodies (strict types, unsupported fields rejected)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.errors import InvalidRequestError
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.protocol_responses import ErrorResponse, UsageInfo


def test_prompt_shapes():
    assert CompletionRequest(model="m", prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=["hi"]).prompts() == ["hi"]
    assert CompletionRequest(model="m", prompt=[[3, 4]]).prompts() == [[3, 4]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(InvalidRequestError) as e:  # 3 prompts x n=50 > 128 choices
        CompletionRequest(model="m", prompt=["a", "b", "c"], n=50).check_unsupported()
    assert e.value.param == "n"


@pytest.mark.parametrize("field,value", [("max_tokens", "5"), ("temperature", "hot"), ("stream", 1),
                                         ("prompt", 5), ("stop", 3), ("seed", 1.5), ("n", "2"), ("prompt", None),
                                         ("model", None)])
def test_wrong_types_are_rejected(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})


def test_null_means_the_default():
    nulls = {k: None for k in ("n", "stream", "echo", "stream_options", "logprobs", "max_tokens", "temperature",
                               "stop", "seed", "ignore_eos", "min_tokens", "logit_bias", "user", "suffix",
                               "best_of", "tools", "response_format")}
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", **nulls})
    r.check_unsupported()
    assert (r.n, r.stream, r.echo, r.ignore_eos, r.min_tokens, r.logprobs) == (1, False, False, False, 0, None)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": None}],
                                                 "logprobs": None, "top_logprobs": None, "n": None,
                                                 "stream": None, "tool_choice": None})
    chat.check_unsupported()
    assert chat.num_logprobs is None and chat.n == 1


@pytest.mark.parametrize("body", [
    {"model": "m\ud800", "prompt": "x"}, {"model": "m", "prompt": "a\udfff"}, {"model": "m", "prompt": ["ok", "\ud83d"]},
    {"model": "m", "prompt": "x", "stop": ["\ud800"]}, {"model": "m", "prompt": "x", "logit_bias": {"\ud800": 1}},
    {"model": "m", "prompt": "x", "bad_words": ["\udc00"]}, {"model": "m", "prompt": "x", "user": "\ud800"},
])
def test_lone_surrogates_are_rejected(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": [{"type": "text", "text": "a\udbff"}]}],
    [{"role": "user", "content": "hi", "name": "\udc00"}],
])
def test_lone_surrogates_in_messages_are_rejected(messages):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def test_ints_are_accepted_for_floats_and_unknown_fields_refused():
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 0, "top_p": 1})
    assert r.temperature == 0.0 and r.top_p == 1.0
    with pytest.raises(ValidationError, match="whatever"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "whatever": 3})


@pytest.mark.parametrize("extra,param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    # Tools are chat's (completions has no template to render them with).
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"use_beam_search": True}, "use_beam_search"), ({"functions": []}, "functions"),
    ({"function_call": "auto"}, "function_call"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_unsupported_features_are_400(extra, param):
    with pytest.raises(InvalidRequestError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **extra}).check_unsupported()
    assert e.value.param == param


def test_logprobs_fields():
    CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 0}).check_unsupported()
    with pytest.raises(ValidationError):  # completions' logprobs is a count, chat's a flag
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": True})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 20})
    r.check_unsupported()
    assert r.num_logprobs == 20
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).num_logprobs == 0
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": False}).num_logprobs is None
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(InvalidRequestError) as e:
            ChatCompletionRequest.model_validate({**chat, **bad}).check_unsupported()
        assert e.value.param == "top_logprobs"


def test_chat_messages():
    r = ChatCompletionRequest.model_validate({"model": "m", "max_completion_tokens": 7, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.requested_max_tokens == 7
    assert [m.as_template_dict() for m in r.messages] == [{"role": "system", "content": "be brief"},
                                                         {"role": "user", "content": "ab"}]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]})


def test_stop_and_usage_and_error_shapes():
    assert CompletionRequest(model="m", prompt="x", stop="\n").stop_strings == ("\n",)
    assert UsageInfo.of(3, 4).total_tokens == 7
    body = ErrorResponse.of("bad", "invalid_request_error", "n").model_dump()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}


def test_no_op_values_of_unsupported_fields_are_accepted():
    CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": 3, "best_of": 3, "echo": True, "suffix": "",
                                      "response_format": {"type": "text"},
                                      "use_beam_search": False}).check_unsupported()


@pytest.mark.parametrize("prompt", [[1, 2**63], [2**63], [-(2**63) - 1], [2**70], [[1], [2**63]], [1, 2.0], [1, True],
                                    [1, "a"], [1, None], [[1, "x"]]])
def test_prompt_token_ids_out_of_int64_or_not_ints_are_400_naming_the_prompt(prompt):
    from fastapi.exceptions import RequestValidationError

    from router.openai.errors import invalid_body

    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    # The union's first member (the string) names the error, as when the ids were list[Int64].
    err = invalid_body(RequestValidationError(e.value.errors()))
    assert (err.status, err.param) == (400, "prompt")
    assert err.message == "prompt.function-after[_valid_unicode(), str]: Input should be a valid string"


def test_prompt_token_ids_at_the_int64_bounds_are_accepted_and_the_schema_keeps_them():
    ids = [-(2**63), 0, 2**63 - 1]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ids}).prompt == ids
    assert CompletionRequest.model_validate({"model": "m", "prompt": [ids, []]}).prompt == [ids, []]
    items = {"type": "integer", "minimum": -(2**63), "exclusiveMaximum": 2**63}
    members = CompletionRequest.model_json_schema()["properties"]["prompt"]["anyOf"]
    assert {"type": "array", "items": items} in members
    assert {"type": "array", "items": {"type": "array", "items": items}} in members
