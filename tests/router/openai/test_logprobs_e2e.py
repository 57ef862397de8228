"""Logprobs and the sampling features through real HTTP with the official `openai` client: completions
and chat, streaming and not, against the reference engine (whose logprobs equal a transformers
log_softmax: tests/cluster/sampling/test_logprobs.py). `fake_cluster` decodes with the engine itself;
`real_pd_cluster` with the real prefill worker (first token and its logprobs in the KV header) and the
real decode worker (the features step of the graph runner; eager on CPU)."""

from __future__ import annotations

import math

import pytest

from cluster.sampling.sampling_params import SamplingParams
from cluster.text.tokenizer import encode_bad_words, encode_chat

openai = pytest.importorskip("openai")

MODEL = "pdserve-demo"
LONG = "Tell me a story about a dragon who lived in the mountains and guarded an ancient treasure"  # > 12 tokens
SHORT = "Hi there"  # <= 12 tokens: prefilled on the decode worker of real_pd_cluster


def _client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _ref(engine, prompt, **kw):
    return engine.generate([prompt], SamplingParams(**kw))[0]


# Float32 logprobs of the same prompt from passes of other shapes (a cached prefix's suffix against the
# whole prompt, another batch size) differ by tens of ulps, and an ulp grows with the value: -7.92 came
# back as -7.922342 against the engine's -7.922353 (1.1e-5, ~24 ulps) on one CPU. Within 1e-5, or 4e-6
# of the value (~35 ulps), whichever is larger.
REL_TOL = 4e-6


def _close(got, want, atol):
    return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=atol)


def _string(engine, t):
    return engine.tokenizer.decode([t])


def _check_completion_logprobs(lp, ref, engine, k, atol):
    assert lp.tokens == [_string(engine, t) for t in ref.token_ids]
    assert len(lp.token_logprobs) == len(ref.token_ids)
    for got, want, top, t in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs, ref.token_ids):
        assert _close(got, want.logprob, atol)
        expected = {_string(engine, i): v for i, v in zip(want.top_ids[:k], want.top_logprobs[:k])}
        expected.setdefault(_string(engine, t), want.logprob)
        assert top.keys() == expected.keys()
        assert all(_close(top[s], v, atol) for s, v in expected.items())
    offsets = [0]
    for s in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp.text_offset == offsets


def _check_chat_logprobs(content, ref, engine, k, atol):
    assert [c.token for c in content] == [_string(engine, t) for t in ref.token_ids]
    for c, want in zip(content, ref.logprobs):
        assert _close(c.logprob, want.logprob, atol)
        assert c.bytes == list(c.token.encode("utf-8"))
        assert [t.token for t in c.top_logprobs] == [_string(engine, i) for i in want.top_ids[:k]]
        assert all(_close(t.logprob, v, atol) for t, v in zip(c.top_logprobs, want.top_logprobs))


@pytest.mark.parametrize("k", [0, 3])
def test_completions_logprobs_streaming_and_not(fake_cluster, reference_engine, k):
    client = _client(fake_cluster)
    ref = _ref(reference_engine, LONG, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=k)
    out = client.completions.create(model=MODEL, prompt=LONG, max_tokens=10, temperature=0, logprobs=k,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text
    _check_completion_logprobs(out.choices[0].logprobs, ref, reference_engine, k, 1e-5)
    if k == 0:
        assert all(len(d) == 1 for d in out.choices[0].logprobs.top_logprobs)  # the sampled token's only
    chunks = [c for c in client.completions.create(model=MODEL, prompt=LONG, max_tokens=10, temperature=0,
                                                   logprobs=k, stream=True, extra_body={"ignore_eos": True})]
    streamed = out.choices[0].logprobs.model_copy(deep=True)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        setattr(streamed, name, [x for c in chunks for x in getattr(c.choices[0].logprobs, name)])
    # The same tokens, offsets and top tokens; the values as the engine's, within the float rule above:
    # the streamed request may find the first one's prompt cached on its worker (a pass of another shape).
    _check_completion_logprobs(streamed, ref, reference_engine, k, 1e-5)
    want = out.choices[0].logprobs
    assert (streamed.tokens, streamed.text_offset) == (want.tokens, want.text_offset)
    assert [d.keys() for d in streamed.top_logprobs] == [d.keys() for d in want.top_logprobs]
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_chat_logprobs_streaming_and_not(fake_cluster, reference_engine):
    client = _client(fake_cluster)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    ids = encode_chat(reference_engine.tokenizer, msgs)
    ref = _ref(reference_engine, ids, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == ref.text
    _check_chat_logprobs(chat.choices[0].logprobs.content, ref, reference_engine, 2, 1e-5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    # As the non-streamed answer: the same tokens, bytes and top tokens, and the engine's values within
    # the float rule above. Not bit for bit: "Tell me a story." is other tests' prompt too, and either
    # request may find it cached on its worker (test_openai_features_e2e.py). The engine alone gives the
    # first token's second top logprob as -7.922342 uncached and -7.922353 with the first block cached.
    _check_chat_logprobs(content, ref, reference_engine, 2, 1e-5)
    assert ([(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in content]
            == [(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in chat.choices[0].logprobs.content])
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_penalties_bias_and_bad_words_equal_the_engine(fake_cluster, real_pd_cluster, reference_engine):
    """Seeded sampling with the features on: the same text from the engine, the engine-backed fake
    cluster and the real disaggregated (LONG) and local-prefill (SHORT) paths."""
    tok = reference_engine.tokenizer
    banned = "the"
    kw = dict(max_tokens=12, temperature=0.9, seed=123, presence_penalty=0.8, frequency_penalty=0.4,
              repetition_penalty=1.2, min_p=0.02, logit_bias={"17": 2.0, "42": -5.0}, bad_words=[banned])
    for prompt in (LONG, SHORT):
        ref = _ref(reference_engine, prompt, max_tokens=12, temperature=0.9, seed=123, presence_penalty=0.8,
                   frequency_penalty=0.4, repetition_penalty=1.2, min_p=0.02, logit_bias={17: 2.0, 42: -5.0},
                   bad_words_token_ids=encode_bad_words(tok, [banned]),
                   logprobs=1)
        for cluster in (fake_cluster, real_pd_cluster):
            out = _client(cluster).completions.create(
                model=MODEL, prompt=prompt, logprobs=1, max_tokens=kw["max_tokens"], temperature=kw["temperature"],
                seed=kw["seed"], presence_penalty=kw["presence_penalty"], frequency_penalty=kw["frequency_penalty"],
                logit_bias=kw["logit_bias"],
                extra_body={k: kw[k] for k in ("repetition_penalty", "min_p", "bad_words")})
            assert out.choices[0].text == ref.text, (cluster is real_pd_cluster, prompt)
            _check_completion_logprobs(out.choices[0].logprobs, ref, reference_engine, 1, 1e-4)


def test_logprobs_on_the_real_workers(real_pd_cluster, reference_engine):
    """First token from the prefill worker (logprobs in the KV header) or the decode worker's local
    prefill, the rest from the decode worker's features step: all equal the engine's."""
    client = _client(real_pd_cluster)
    for prompt in (LONG, SHORT):
        ref = _ref(reference_engine, prompt, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=4)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=4,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == ref.text
        _check_completion_logprobs(out.choices[0].logprobs, ref, reference_engine, 4, 1e-4)
        msgs = [{"role": "user", "content": prompt}]
        ref = _ref(reference_engine, encode_chat(reference_engine.tokenizer, msgs), max_tokens=5, temperature=0.0,
                   ignore_eos=True, logprobs=3)
        chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True,
                                                     extra_body={"ignore_eos": True}))
        content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
        _check_chat_logprobs(content, ref, reference_engine, 3, 1e-4)
