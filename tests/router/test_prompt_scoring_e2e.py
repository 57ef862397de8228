"""Prompt scoring through real HTTP with the real prefill and decode workers:

- lm-eval's `local-completions` log-likelihood request (echo: true, max_tokens: 0, logprobs: 1,
  temperature 0; the prompt a string, a list of token ids, or a batch of token-id lists): the
  prompt's text and logprobs come back, no completion token, finish_reason "length", and every
  logprob equals a transformers log_softmax of the demo model's logits (the top-1 entry tells lm-eval
  whether the continuation is greedy);
- vLLM's `prompt_logprobs: k` (completions and chat): per prompt token {id: {logprob, rank,
  decoded_token}}, the same numbers;
- echo with max_tokens 0 and no logprobs: the prompt's text alone.
"""

from __future__ import annotations

import math

import pytest
import torch

openai = pytest.importorskip("openai")

MODEL = "pdserve-demo"
LONG = "Tell me a story about a dragon who lived in the mountains and guarded an ancient treasure"  # > 12 tokens
SHORT = "Hi there"  # <= 12 tokens: prefilled on the decode worker
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_log_softmax(demo_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def lsm(ids: list[int]) -> torch.Tensor:
        """Row i: log-probabilities of token i + 1 given tokens 0..i."""
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lsm


def _client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_scored(choice, ids, tok, lsm, k=1):
    """lm-eval's reading of a choice: the tokens' logprobs (the first none) and whether each token is
    the greedy one (its own top entry); all equal HF's."""
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = lsm(ids)
    for j in range(1, len(ids)):
        row = ref[j - 1]
        assert math.isclose(lp.token_logprobs[j], row[ids[j]].item(), abs_tol=ATOL)
        top = torch.topk(row, k)
        want = {tok.decode([int(t)]): v.item() for t, v in zip(top.indices, top.values)}
        want.setdefault(tok.decode([ids[j]]), row[ids[j]].item())
        got = lp.top_logprobs[j]
        assert got.keys() == want.keys() and all(math.isclose(got[s], v, abs_tol=ATOL) for s, v in want.items())
        greedy = int(row.argmax()) == ids[j]
        assert greedy == (max(got, key=got.get) == tok.decode([ids[j]]))  # what lm-eval's is_greedy reads


@pytest.mark.parametrize("prompt", [LONG, SHORT], ids=["prefill_worker", "local_prefill"])
def test_lm_eval_loglikelihood_request_equals_transformers(real_pd_cluster, reference_engine, hf_log_softmax, prompt):
    tok = reference_engine.tokenizer
    client = _client(real_pd_cluster)
    ids = list(tok(prompt).input_ids)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0.0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    _check_scored(c, ids, tok, hf_log_softmax)


def test_lm_eval_batched_token_id_prompts(real_pd_cluster, reference_engine, hf_log_softmax):
    """lm-eval sends context + continuation as token ids, several requests in one body."""
    tok = reference_engine.tokenizer
    batch = [list(tok(p).input_ids) for p in (LONG, SHORT, "The quick brown fox jumps over the lazy dog")]
    r = _client(real_pd_cluster).completions.create(model=MODEL, prompt=batch, echo=True, max_tokens=0, logprobs=1,
                                                    temperature=0.0, seed=1234)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 0
    for c, ids in zip(r.choices, batch):
        assert c.text == tok.decode(ids)
        _check_scored(c, ids, tok, hf_log_softmax)


def test_vllm_prompt_logprobs_field(real_pd_cluster, reference_engine, hf_log_softmax):
    tok = reference_engine.tokenizer
    client = _client(real_pd_cluster)
    k = 3
    for prompt in (LONG, SHORT):
        ids = list(tok(prompt).input_ids)
        ref = hf_log_softmax(ids)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0,
                                      extra_body={"prompt_logprobs": k})
        chat_msgs = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=1, temperature=0.0,
                                              extra_body={"prompt_logprobs": k})
        from cluster.text.tokenizer import encode_chat

        for plp, pids in ((r.choices[0].prompt_logprobs, ids), (chat.prompt_logprobs, encode_chat(tok, chat_msgs))):
            pref = hf_log_softmax(pids)
            assert len(plp) == len(pids) and plp[0] is None
            for j in range(1, len(pids)):
                entry = {int(t): v for t, v in plp[j].items()}
                row = pref[j - 1]
                top = torch.topk(row, k)
                want = [pids[j]] + [int(t) for t in top.indices if int(t) != pids[j]]
                assert list(entry) == want[: len(entry)] and set(entry) == {pids[j], *map(int, top.indices)}
                for t, e in entry.items():
                    assert math.isclose(e["logprob"], row[t].item(), abs_tol=ATOL)
                    assert e["decoded_token"] == tok.decode([t])
                    rank = (top.indices == t).nonzero()
                    assert e["rank"] == (int(rank[0]) + 1 if len(rank) else None)
        assert ref.shape[0] == len(ids)


def test_echo_without_tokens_or_logprobs_is_the_prompt(real_pd_cluster):
    client = _client(real_pd_cluster)
    for prompt in (LONG, SHORT):
        r = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
        c = r.choices[0]
        assert c.text == prompt and c.logprobs is None and c.finish_reason == "length"
        assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:  # nothing asked at all
        client.completions.create(model=MODEL, prompt=SHORT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # as vLLM: prompt logprobs come with a whole response
        client.completions.create(model=MODEL, prompt=SHORT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
