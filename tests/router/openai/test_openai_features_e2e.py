"""n, batched prompts, echo, nulls, invalid Unicode, stop_token_ids and the fields we refuse, through
real HTTP with the official `openai` client (and raw httpx where the client would not send the body).
`fake_cluster` decodes with the engine itself behind the real token publisher; `real_pd_cluster` runs
the real prefill and decode workers."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_harness import wait_clean

from cluster.sampling.sampling_params import SamplingParams
from cluster.text.tokenizer import encode_prompt

openai = pytest.importorskip("openai")

MODEL = "pdserve-demo"
LONG = "Tell me a story about a dragon who lived in the mountains and guarded an ancient treasure"  # > 12 tokens
SHORT = "Hi there"


def _client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _seeded(client, prompt, seed, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=seed,
                                     extra_body={"ignore_eos": True}, **kw)


def test_n_and_batched_prompts_equal_separate_seeded_requests(fake_cluster):
    _check_n_and_batched_prompts(fake_cluster)


def test_n_and_batched_prompts_on_the_real_workers(real_pd_cluster):
    _check_n_and_batched_prompts(real_pd_cluster)


def _check_n_and_batched_prompts(cluster):
    """Choice p * n + i is prompt p's i-th choice and samples with seed + i (vLLM's rule)."""
    client = _client(cluster)
    prompts, n, seed = [LONG, SHORT], 3, 1234
    out = _seeded(client, prompts, seed, n=n)
    assert [c.index for c in out.choices] == list(range(len(prompts) * n))
    singles = [[_seeded(client, p, seed + i).choices[0].text for i in range(n)] for p in prompts]
    assert [c.text for c in out.choices] == [t for row in singles for t in row]
    assert len(set(singles[0])) > 1  # the seeds differ, so do the samples
    prompt_tokens = sum(_seeded(client, p, seed).usage.prompt_tokens for p in prompts)
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == len(prompts) * n * 8

    # Streaming: every choice's chunks, in its own index, add up to the same texts.
    texts: dict[int, str] = {}
    finished = set()
    for chunk in _seeded(client, prompts, seed, n=n, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert [texts[i] for i in range(len(prompts) * n)] == [c.text for c in out.choices]
    assert finished == set(range(len(prompts) * n))


def test_chat_n(fake_cluster):
    client = _client(fake_cluster)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(n=2, seed=7, **kw)
    singles = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (7, 8)]
    assert [c.message.content for c in out.choices] == singles
    roles = {}
    for chunk in client.chat.completions.create(n=2, seed=7, stream=True, **kw):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
    assert roles == {0: "assistant", 1: "assistant"}


def test_batched_token_id_prompts(fake_cluster, reference_engine):
    tok = reference_engine.tokenizer
    ids = [encode_prompt(tok, LONG), encode_prompt(tok, SHORT)]
    out = _client(fake_cluster).completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                                   extra_body={"ignore_eos": True})
    refs = reference_engine.generate(ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [c.text for c in out.choices] == [r.text for r in refs]


def test_echo_with_and_without_logprobs(fake_cluster, reference_engine):
    _check_echo(fake_cluster, reference_engine)


def test_echo_on_the_real_workers(real_pd_cluster, reference_engine):
    _check_echo(real_pd_cluster, reference_engine)


def _check_echo(cluster, reference_engine):
    client = _client(cluster)
    tok = reference_engine.tokenizer
    ref = reference_engine.generate([LONG], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                           logprobs=2, prompt_logprobs=2))[0]
    plain = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == LONG + ref.text and plain.choices[0].logprobs is None
    out = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, temperature=0, echo=True, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    ids = list(ref.prompt_token_ids) + list(ref.token_ids)
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [p.logprob for p in ref.prompt_logprobs[1:]] + [p.logprob for p in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for top, p, t in zip(lp.top_logprobs[1:], list(ref.prompt_logprobs[1:]) + list(ref.logprobs), ids[1:]):
        expected = {tok.decode([i]): v for i, v in zip(p.top_ids[:2], p.top_logprobs[:2])}
        expected.setdefault(tok.decode([t]), p.logprob)
        assert top.keys() == expected.keys()
    # Streaming: the prompt comes first, once.
    chunks = list(client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == LONG + ref.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_stop_token_ids_text_is_not_output(fake_cluster, real_pd_cluster, reference_engine):
    ref = reference_engine.generate([LONG], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    k = 4
    stop_id = ref.token_ids[k]
    first = ref.token_ids.index(stop_id)  # it may occur earlier
    upto = reference_engine.generate([LONG], SamplingParams(max_tokens=first, temperature=0.0, ignore_eos=True))[0] \
        if first else None
    for cluster in (fake_cluster, real_pd_cluster):
        out = _client(cluster).completions.create(model=MODEL, prompt=LONG, max_tokens=10, temperature=0,
                                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
        c = out.choices[0]
        assert c.finish_reason == "stop" and out.usage.completion_tokens == first + 1
        assert c.text == (upto.text if upto else "")


def test_nulls_are_accepted(fake_cluster):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 3, "temperature": 0, "stream": None, "n": None,
            "echo": None, "logprobs": None, "stop": None, "seed": None, "stream_options": None, "user": None,
            "presence_penalty": None, "frequency_penalty": None, "logit_bias": None, "best_of": None,
            "suffix": None, "top_p": None}
    r = httpx.post(f"{fake_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    chat = {"model": MODEL, "messages": [{"role": "user", "content": SHORT, "name": None}], "max_tokens": 3,
            "stream": None, "n": None, "logprobs": None, "top_logprobs": None, "tools": None, "tool_choice": None,
            "response_format": None, "max_completion_tokens": None, "parallel_tool_calls": None}
    r = httpx.post(f"{fake_cluster.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"model": "pdserve-demo", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "pdserve-demo", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "pdserve-\\ud800", "prompt": "hi"}'),
    ("/v1/completions", '{"model": "pdserve-demo", "prompt": "hi", "logit_bias": {"\\ud800": 1}}'),
    ("/v1/completions", '{"model": "pdserve-demo", "prompt": "hi", "stop": "\\ud800"}'),
    ("/v1/chat/completions", '{"model": "pdserve-demo", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", '{"model": "pdserve-demo", "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "x\\udbff"}]}]}'),
    ("/v1/chat/completions", '{"model": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/completions", b'{"model": "pdserve-demo", "prompt": "\xed\xa0\x80"}'),  # a surrogate as UTF-8 bytes
])
def test_invalid_unicode_is_400(fake_cluster, path, raw):
    with httpx.Client(base_url=fake_cluster.url, timeout=30) as c:
        for _ in range(2):  # the connection is kept and serves the next request
            r = c.post(path, content=raw if isinstance(raw, bytes) else raw.encode(),
                       headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] in ("prompt", "model", "messages",
                                                                                "logit_bias", "stop")
            assert r.headers.get("connection") != "close"


@pytest.mark.parametrize("field,value", [
    ("use_beam_search", True), ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
def test_unimplemented_fields_are_400_naming_them(fake_cluster, field, value):
    client = _client(fake_cluster)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field
    # The no-op value is fine.
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   response_format={"type": "text"})


@pytest.mark.parametrize("path,extra,param,words", [
    # Tools are chat's; this cluster has no --tool-call-parser: "auto" needs one (forced calls do not).
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "chat/completions"),
    ("/v1/completions", {"tool_choice": "auto"}, "tool_choice", "chat/completions"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "--enable-auto-tool-choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_tools_the_server_cannot_serve_are_400(fake_cluster, path, extra, param, words):
    body = {"model": MODEL, "max_tokens": 2, **extra,
            **({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    r = httpx.post(f"{fake_cluster.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_tools_with_tool_choice_none_are_rendered_not_parsed(fake_cluster):
    client = _client(fake_cluster)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def test_a_refused_choice_leaves_nothing_running(fake_cluster):
    """A request whose choices cannot all be admitted (128 x ~420 tokens: the two workers hold 2 x 4096,
    their decoding held slow here so none finishes meanwhile, and an admission queue of 0 so that the
    first choice that does not fit is refused at once) is refused whole, and the choices placed before
    the refusal are aborted. (With the default queue its choices wait and are all served.)"""
    import dataclasses

    import ray

    ac = fake_cluster.router.admission
    before = ac.limits
    decode = list(fake_cluster.workers.decode.values())

    def limit(to):
        def set_():
            ac.limits = dataclasses.replace(ac.limits, max_waiting_requests=to)
        fake_cluster.call(set_)
    too_many = {"model": MODEL, "prompt": LONG, "max_tokens": 400, "n": 128, "ignore_eos": True}
    limit(0)
    ray.get([d.set_step_delay.remote(0.05) for d in decode])  # 400 tokens take 20 s: nothing frees meanwhile
    try:
        r = httpx.post(f"{fake_cluster.url}/v1/completions", content=json.dumps(too_many),
                       headers={"content-type": "application/json"}, timeout=120)
    finally:
        ray.get([d.set_step_delay.remote(0.0) for d in decode])
        limit(before.max_waiting_requests)
    assert r.status_code == 429 and "max_waiting_requests=0" in r.json()["error"]["message"], r.text[:500]
    wait_clean(fake_cluster)  # fails unless every worker and the router hold nothing
    out = _client(fake_cluster).completions.create(model=MODEL, prompt=SHORT, max_tokens=2)
    assert out.choices[0].finish_reason is not None
