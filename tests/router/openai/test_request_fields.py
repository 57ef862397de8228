"""Every field a request model declares has an effect or a documented refusal; every other key is a
400 naming it (OpenAI's "Unrecognized request argument supplied"). Nothing is accepted and ignored.

The walk goes over the request models' own field lists (router/openai/protocol.py, the one place
the accepted fields live), so a field added there without an effect fails here until it has a probe
below (two values whose served requests differ) or an entry in UNSUPPORTED_FIELDS (a value that asks
for something is a 400 naming it). A request's "plan" is what the gateway would submit: per prompt
its token ids and SamplingParams, the choices (n) and seeds, and how the response is rendered (stream,
usage chunk, echo, logprobs). No Ray here: the gateway's own serving classes over a stand-in gateway.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from cluster.errors import InvalidRequestError
from cluster.text.tokenizer import load_tokenizer
from router.stats.metrics import GatewayMetrics
from router.openai.errors import APIError
from router.openai.gateway_config import GatewayConfig
from router.openai.protocol import (UNSUPPORTED_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                    DetokenizeRequest, StreamOptions, TextContentPart, TokenizeRequest)
from router.openai.routes import build_app
from router.openai.serving_chat import OpenAIServingChat
from router.openai.serving_completion import OpenAIServingCompletion

MODEL = "m"
TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}{% endif %}"
            "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>{{ m.content }}"
            "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
            "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


class StandIn:
    """What the serving classes and the routes read of a Gateway, without a router behind it."""

    class Placed(Exception):
        pass

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cfg = GatewayConfig(MODEL, 4096, vocab_size=len(tokenizer), tool_call_parser="hermes",
                                 enable_auto_tool_choice=True)
        self.metrics = GatewayMetrics(MODEL)
        self.draining, self.ready = False, True

    async def start(self):
        pass

    async def stop(self):
        pass

    def check_accepting(self):
        pass

    def check_model(self, name):
        from router.openai.errors import model_not_found

        if name != MODEL:
            raise model_not_found(name)

    def kv_capacity_tokens(self):
        return 0

    async def off_loop(self, fn, *args):
        return fn(*args)

    async def start_generation(self, *a, **kw):
        raise StandIn.Placed()


@pytest.fixture(scope="module")
def gw(demo_model_dir):
    return StandIn(load_tokenizer(demo_model_dir, TEMPLATE))


def plan(gw, model: type[BaseModel], body: dict):
    """What the gateway would submit and render for `body`, or ("refused", param) / ("invalid", locs)."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        return ("invalid", tuple(tuple(err["loc"]) for err in e.errors()))
    serving = (OpenAIServingCompletion if model is CompletionRequest else OpenAIServingChat)(gw)
    try:
        gw.check_model(req.model)
        req.check_unsupported()
        opts = serving.options(req)
        n_lp = serving.num_logprobs(req)
        echo = serving.echo(req)
        prompts = []
        tokenized, bad_words = serving.tokenize(req, opts, echo)
        for _, ids, _ in tokenized:
            mt = serving.max_tokens(req, ids)
            params = serving.sampling_params(req, opts, mt, n_lp, serving.prompt_logprobs(req, n_lp, echo, mt),
                                             bad_words)
            prompts.append((tuple(ids), params))
    except (InvalidRequestError, APIError) as e:
        return ("refused", getattr(e, "param", None))
    seeds = None if req.seed is None else [(req.seed + i) % 2**63 for i in range(req.n)]
    return {"prompts": prompts, "n": req.n, "seeds": seeds, "stream": req.stream, "usage_chunk": req.include_usage,
            "usage_per_chunk": req.continuous_usage,
            "echo": echo, "logprobs": n_lp, "tools": opts.tools}


CMPL = {"model": MODEL, "prompt": "Once upon a time"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
SAMPLING = {  # field: (value a, value b) whose plans differ, for both endpoints
    "model": (MODEL, "other"), "max_tokens": (5, 7), "temperature": (0.0, 0.5), "top_p": (1.0, 0.5),
    "top_k": (0, 5), "n": (1, 2), "stream": (False, True), "stop": (None, ["x"]), "stop_token_ids": (None, [3]),
    "seed": (None, 7), "ignore_eos": (False, True), "min_tokens": (0, 2), "presence_penalty": (None, 0.5),
    "frequency_penalty": (None, 0.5), "repetition_penalty": (None, 1.2), "min_p": (None, 0.1),
    "logit_bias": (None, {"3": 5.0}), "allowed_token_ids": (None, [3, 4]), "bad_words": (None, ["upon"]),
    "stream_options": ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}),
    "skip_special_tokens": (True, False), "prompt_logprobs": (None, 2),
    "response_format": ({"type": "text"}, {"type": "json_object"}), "guided_json": (None, {"type": "object"}),
    "guided_regex": (None, "a+"), "guided_choice": (None, ["a", "b"]), "guided_grammar": (None, 'root ::= "a"'),
    "structured_outputs": (None, {"regex": "a+"}),
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
PROBES: dict[type, dict[str, tuple]] = {
    CompletionRequest: {**SAMPLING, "prompt": ("Once upon a time", [5, 6, 7]), "echo": (False, True),
                        "logprobs": (None, 2)},
    ChatCompletionRequest: {**SAMPLING, "messages": ([{"role": "user", "content": "Hello"}],
                                                     [{"role": "user", "content": "Bye"}]),
                            "max_completion_tokens": (5, 7), "logprobs": (False, True),
                            "top_logprobs": ({"logprobs": True}, {"logprobs": True, "top_logprobs": 3}),
                            "tools": (None, [TOOL]),
                            "tool_choice": ({"tools": [TOOL], "tool_choice": "none"},
                                            {"tools": [TOOL], "tool_choice": "required"}),
                            "parallel_tool_calls": ({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": True},
                                                    {"tools": [TOOL], "tool_choice": "required",
                                                     "parallel_tool_calls": False})},
}
MESSAGE_PROBES = {  # ChatMessage / TextContentPart / StreamOptions fields, through a chat request
    "role": ({"role": "user", "content": "x"}, {"role": "system", "content": "x"}),
    "content": ({"role": "user", "content": "x"}, {"role": "user", "content": "y"}),
    "name": ({"role": "user", "content": "x"}, {"role": "user", "content": "x", "name": "ann"}),
    "tool_calls": ({"role": "assistant", "content": "x"}, {"role": "assistant", "content": "x", "tool_calls": [CALL]}),
    "tool_call_id": ({"role": "tool", "content": "x", "tool_call_id": "a"},
                     {"role": "tool", "content": "x", "tool_call_id": "b"}),
    "annotations": ({"role": "assistant", "content": "x", "annotations": []},
                    {"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}),
}
PART_PROBES = {"text": ("x", "y"), "type": ("text", "image_url")}
# Whose effect is not in the plan: `user` is logged with the request (test_user_is_logged_with_the_request).
LOGGED = {"user"}
# Refused by a rule of their own (checked in check_unsupported), not by UNSUPPORTED_FIELDS:
CHECKED = {CompletionRequest: {"best_of": ({"best_of": 1}, {"best_of": 3})}}
# A value that asks for something, for every UNSUPPORTED_FIELDS entry (each must be a 400 naming it).
ASKING = {"functions": [{"name": "f"}], "function_call": "auto", "use_beam_search": True, "suffix": "x",
          "reasoning_effort": "low", "store": True, "metadata": {"k": "v"}, "service_tier": "flex",
          "modalities": ["audio"], "audio": {"voice": "x"}, "prediction": {"type": "content", "content": "x"},
          "web_search_options": {}, "refusal": "no",
          # chat only: /v1/completions refuses them (no chat template to render tools with)
          "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
MESSAGE_UNSUPPORTED = {"refusal", "function_call", "audio"}


def _with(base: dict, field: str, value):
    if isinstance(value, dict) and field in ("stream_options", "top_logprobs", "best_of", "tool_choice", "parallel_tool_calls"):
        return {**base, **value}  # a field that only means something with another one set
    return {**base, field: value}


@pytest.mark.parametrize("model,base", [(CompletionRequest, CMPL), (ChatCompletionRequest, CHAT)], ids=["completion", "chat"])
def test_every_request_field_has_an_effect_or_a_refusal(gw, model, base):
    unaccounted = [f for f in model.model_fields
                   if f not in PROBES[model] and f not in model.unsupported and f not in CHECKED.get(model, {})
                   and f not in LOGGED]
    assert not unaccounted, f"{model.__name__} fields with neither an effect probe nor a refusal: {unaccounted}"
    assert plan(gw, model, base) != plan(gw, model, {**base, "model": "x"})
    for field, (a, b) in {**PROBES[model], **CHECKED.get(model, {})}.items():
        pa, pb = plan(gw, model, _with(base, field, a)), plan(gw, model, _with(base, field, b))
        assert isinstance(pa, dict), (field, pa)
        assert pa != pb, f"{model.__name__}.{field}: {a!r} and {b!r} are served alike"
    for field in model.unsupported:
        if field in model.model_fields:
            assert plan(gw, model, {**base, field: ASKING[field]}) == ("refused", field), field
            assert isinstance(plan(gw, model, {**base, field: None}), dict), field  # null asks for nothing


def test_message_fields_have_an_effect_or_a_refusal(gw):
    for model, probes in ((ChatMessage, MESSAGE_PROBES), (TextContentPart, PART_PROBES)):
        unaccounted = [f for f in model.model_fields if f not in probes and f not in MESSAGE_UNSUPPORTED]
        assert not unaccounted, (model.__name__, unaccounted)
    for field, (a, b) in MESSAGE_PROBES.items():
        pa = plan(gw, ChatCompletionRequest, {**CHAT, "messages": [a]})
        pb = plan(gw, ChatCompletionRequest, {**CHAT, "messages": [b]})
        assert isinstance(pa, dict) and pa != pb, (field, pa, pb)
    for field, (a, b) in PART_PROBES.items():
        msg = lambda v: {"role": "user", "content": [{"type": "text", "text": "x", field: v}]}  # noqa: E731
        assert plan(gw, ChatCompletionRequest, {**CHAT, "messages": [msg(a)]}) != \
            plan(gw, ChatCompletionRequest, {**CHAT, "messages": [msg(b)]}), field
    for field in MESSAGE_UNSUPPORTED:
        m = {"role": "assistant", "content": "x", field: ASKING[field]}
        assert plan(gw, ChatCompletionRequest, {**CHAT, "messages": [m]}) == ("refused", field), field
        # what OpenAI's SDK hands back (nulls) is accepted as the plain message
        null = {"role": "assistant", "content": "x", field: None}
        assert plan(gw, ChatCompletionRequest, {**CHAT, "messages": [null]}) == \
            plan(gw, ChatCompletionRequest, {**CHAT, "messages": [{"role": "assistant", "content": "x"}]})
    assert set(StreamOptions.model_fields) == {"include_usage", "continuous_usage_stats"}  # through stream_options
    usage = lambda **o: plan(gw, ChatCompletionRequest, {**CHAT, "stream": True, "stream_options": o})  # noqa: E731
    assert usage(include_usage=True) != usage(include_usage=True, continuous_usage_stats=True)


def test_user_is_logged_with_the_request(gw, caplog):
    class Req:  # a Starlette Request's parts that serve() reads
        scope: dict = {}

        async def receive(self):
            await asyncio.sleep(3600)

    async def serve(body):
        try:
            await OpenAIServingCompletion(gw).serve(CompletionRequest.model_validate(body), Req())
        except StandIn.Placed:
            pass
    with caplog.at_level(logging.INFO, logger="router.openai.serving"):
        asyncio.run(serve({**CMPL, "user": "alice-42"}))
        asyncio.run(serve(CMPL))
    said = [r.getMessage() for r in caplog.records if "user" in r.getMessage()]
    assert len(said) == 1 and "'alice-42'" in said[0] and said[0].startswith("cmpl-")


def test_tokenize_and_detokenize_fields(gw):
    with TestClient(build_app(gw)) as c:
        tok = lambda **b: c.post("/tokenize", json=b).json()  # noqa: E731
        a = tok(prompt="Hello there")
        assert a["tokens"] != tok(prompt="Hello there", add_special_tokens=False)["tokens"] or \
            gw.tokenizer("x").input_ids == gw.tokenizer("x", add_special_tokens=False).input_ids
        assert tok(prompt="Hello", model=MODEL)["tokens"] == tok(prompt="Hello")["tokens"]
        assert c.post("/tokenize", json={"prompt": "Hello", "model": "other"}).status_code == 404
        chat = tok(messages=[{"role": "user", "content": "Hello"}])["tokens"]
        assert chat != a["tokens"]
        assert c.post("/tokenize", json={"messages": [{"role": "user", "content": "x", "refusal": "no"}]}).status_code == 400
        d = c.post("/detokenize", json={"tokens": a["tokens"]}).json()
        assert d["prompt"] and c.post("/detokenize", json={"tokens": a["tokens"], "model": "other"}).status_code == 404
    assert set(TokenizeRequest.model_fields) == {"model", "prompt", "messages", "add_special_tokens"}
    assert set(DetokenizeRequest.model_fields) == {"model", "tokens"}


@pytest.mark.parametrize("path,body", [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT), ("/tokenize", {"prompt": "x"})])
def test_unknown_fields_are_a_400_naming_them(gw, path, body):
    with TestClient(build_app(gw)) as c:
        r = c.post(path, json={**body, "reasoning": {"effort": "low"}, "frobnicate": None})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == "Unrecognized request argument supplied: reasoning, frobnicate"
        assert err["type"] == "invalid_request_error" and err["param"] == "reasoning"
        if "messages" in body:  # inside a message too
            r = c.post(path, json={**body, "messages": [{"role": "user", "content": "x", "weight": 1}]})
            assert r.status_code == 400 and r.json()["error"]["message"] == \
                "Unrecognized request argument supplied: messages.0.weight"
