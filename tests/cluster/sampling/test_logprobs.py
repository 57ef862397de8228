"""Logprobs and the logits processors of the engine against Hugging Face transformers on the demo
checkpoint, in float32: logprobs equal a log_softmax of HF's logits; greedy decoding with penalties,
logit_bias and allowed_token_ids equals a plain reference (vLLM's rules, written here from scratch)
applied to HF's logits step by step."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.sampling.sampling_params import SamplingParams

PROMPT = "Once upon a time there was a little dragon who"


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, block_size=16, num_blocks=64, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf(demo_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def test_logprobs_equal_transformers_log_softmax(engine, hf):
    k = 4
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=k,
                                                   prompt_logprobs=k))[0]
    ids = list(out.prompt_token_ids) + list(out.token_ids)
    lsm = torch.log_softmax(_hf_logits(hf, ids), dim=-1)
    n = len(out.prompt_token_ids)
    # Position i's logprobs are those of token i + 1 given tokens 0..i.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    rows = [(out.prompt_logprobs[j], j - 1, ids[j]) for j in range(1, n)]
    rows += [(out.logprobs[j], n - 1 + j, ids[n + j]) for j in range(len(out.token_ids))]
    for lp, row, token in rows:
        ref = lsm[row]
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
        top = torch.topk(ref, k)
        assert list(lp.top_ids) == top.indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)


def _reference_greedy(hf, prompt: list[int], steps: int, presence: float, frequency: float, repetition: float,
                      bias: dict[int, float], allowed: list[int] | None) -> list[int]:
    """vLLM's order on the raw logits: allowed_token_ids mask, logit_bias, repetition penalty (prompt
    and generated tokens: x / r if x > 0 else x * r), frequency and presence over generated counts."""
    out: list[int] = []
    for _ in range(steps):
        x = _hf_logits(hf, prompt + out)[-1].clone()
        if allowed is not None:
            mask = torch.full_like(x, float("-inf"))
            mask[allowed] = 0.0
            x = x + mask
        for t, b in bias.items():
            x[t] += b
        seen = set(prompt) | set(out)
        for t in seen:
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize("kw", [
    dict(presence=0.8, frequency=0.5, repetition=1.3, bias={}, allowed=None),
    dict(presence=-0.5, frequency=0.0, repetition=0.8, bias={17: 3.0, 42: -4.0, 101: 5.0}, allowed=None),
    dict(presence=0.0, frequency=1.5, repetition=1.0, bias={}, allowed=list(range(5, 400, 3))),
])
def test_penalties_equal_the_reference(engine, hf, kw):
    steps = 12
    ref_prompt = list(engine.tokenizer(PROMPT).input_ids)
    want = _reference_greedy(hf, ref_prompt, steps, **kw)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, presence_penalty=kw["presence"],
                            frequency_penalty=kw["frequency"], repetition_penalty=kw["repetition"],
                            logit_bias=kw["bias"], allowed_token_ids=kw["allowed"])
    got = engine.generate([PROMPT], params)[0]
    assert list(got.token_ids) == want
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    assert list(plain.token_ids) != want  # the processors changed the output: the test can fail
