"""Prompt scoring through real HTTP (lm-eval's local-completions log-likelihood request: echo, max_tokens 0,
logprobs) with the real prefill and decode workers: the prompt's text and logprobs come back, no
completion token, finish_reason "length"; the logprobs are the reference engine's (which equal a
transformers log_softmax: tests/cluster/test_logprobs.py)."""

from __future__ import annotations

import math

import pytest

from cluster.sampling_params import SamplingParams

openai = pytest.importorskip("openai")

LONG = "Tell me a story about a dragon who lived in the mountains and guarded an ancient treasure"  # > 12 tokens
SHORT = "Hi there"  # <= 12 tokens: prefilled on the decode worker


@pytest.mark.parametrize("prompt", [LONG, SHORT], ids=["prefill_worker", "local_prefill"])
def test_echo_with_zero_max_tokens_scores_the_prompt(real_pd_cluster, reference_engine, prompt):
    client = openai.OpenAI(base_url=f"{real_pd_cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    ref = reference_engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    r = client.completions.create(model="pdserve-demo", prompt=prompt, echo=True, max_tokens=0, logprobs=1,
                                  temperature=0.0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    strings = [reference_engine.tokenizer.decode([t]) for t in ref.prompt_token_ids]
    assert lp.tokens == strings and lp.token_logprobs[0] is None
    for got, want in zip(lp.token_logprobs[1:], ref.prompt_logprobs[1:]):
        assert math.isclose(got, want.logprob, abs_tol=1e-4)
