"""The in-process engine with its model split over two processes (gloo, the torch reference path): greedy
output equals the one-process engine's and Hugging Face's `generate` on every architecture the suite
covers (Llama with GQA and tied embeddings, Qwen2 with q/k/v bias, Mistral with one KV head, replicated
on both ranks, and a sliding window); seeded sampling equals too (both ranks draw the same token from the
same gathered logits); the follower leaves cleanly."""

import random

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the follower rank in a spawned process

NEW_TOKENS = 24


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in (1, 9, 64, 157)]


@pytest.fixture(params=["demo_model_dir", "qwen2_model_dir", "mistral_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def test_greedy_tp2_equals_tp1_and_hf_generate(model_dir):
    from transformers import AutoModelForCausalLM

    prompts = _prompts(0)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    tp2 = LLMEngine(model_dir, dtype="float32", max_prefill_tokens=128, tensor_parallel_size=2)
    try:
        out2 = tp2.generate(prompts, greedy)
        sampled2 = tp2.generate(prompts, seeded)
        assert tp2.allocator.num_used == 0
        assert tp2.runner.group.publisher.sent > len(prompts) * NEW_TOKENS // 4  # every pass announced
    finally:
        tp2.close()
    assert tp2._launcher.join() == [0]  # the follower left its loop on Stop and exited cleanly
    tp1 = LLMEngine(model_dir, dtype="float32", max_prefill_tokens=128)
    out1 = tp1.generate(prompts, greedy)
    assert [o.token_ids for o in out2] == [o.token_ids for o in out1]
    assert [o.token_ids for o in sampled2] == [o.token_ids for o in tp1.generate(prompts, seeded)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos is "EOS is a token like any other": HF's min_new_tokens would mask it instead.
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, out2):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
        assert list(out.token_ids) == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
