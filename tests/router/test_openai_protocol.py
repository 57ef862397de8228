"""Request validation of the OpenAI-compatible bodies (strict types, unsupported fields rejected)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.errors import InvalidRequestError
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, UsageInfo


def test_prompt_shapes():
    assert CompletionRequest(model="m", prompt="hi").single_prompt() == "hi"
    assert CompletionRequest(model="m", prompt=[1, 2]).single_prompt() == [1, 2]
    assert CompletionRequest(model="m", prompt=["hi"]).single_prompt() == "hi"
    assert CompletionRequest(model="m", prompt=[[3, 4]]).single_prompt() == [3, 4]
    with pytest.raises(InvalidRequestError):
        CompletionRequest(model="m", prompt=["a", "b"]).single_prompt()


@pytest.mark.parametrize("field,value", [("max_tokens", "5"), ("temperature", "hot"), ("stream", 1),
                                         ("prompt", 5), ("stop", 3), ("seed", 1.5), ("n", None)])
def test_wrong_types_are_rejected(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})


def test_ints_are_accepted_for_floats_and_unknown_fields_ignored():
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 0, "top_p": 1, "whatever": 3})
    assert r.temperature == 0.0 and r.top_p == 1.0


@pytest.mark.parametrize("extra,param", [({"n": 2}, "n"), ({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                                         ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
                                         ({"stream_options": {"include_usage": True}}, "stream_options")])
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
