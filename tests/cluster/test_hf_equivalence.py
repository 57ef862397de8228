"""pdserve's model against Hugging Face transformers on the same checkpoint, in float32."""

import random

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.model_runner import PrefillChunk
from cluster.sampling.sampling_params import SamplingParams

NEW_TOKENS = 32


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 9, 31, 64, 100, 157, 230, 260]
    return [[0] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in lengths]


@pytest.fixture(params=["demo_model_dir", "qwen2_model_dir", "mistral_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_greedy_tokens_equal_hf_generate(model_dir, hf_model):
    prompts = _prompts(0)
    engine = LLMEngine(model_dir, dtype="float32", max_prefill_tokens=512)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=2)
        assert list(out.token_ids) == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
    assert engine.allocator.num_used == 0


@pytest.mark.gpu
def test_greedy_tokens_equal_hf_generate_with_the_fused_kernels_on_gpu(model_dir, hf_model):
    """The GPU path (rotary/KV, norm, SiLU kernels; packed prefill and split-K decode attention) in
    float32 against transformers on CPU."""
    prompts = _prompts(0)
    engine = LLMEngine(model_dir, dtype="float32", device="cuda", attention_backend="triton", max_prefill_tokens=512)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=2)
        assert list(out.token_ids) == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"


def test_prefill_logits_match_hf(model_dir, hf_model):
    engine = LLMEngine(model_dir, dtype="float32")
    prompts = _prompts(1)[-3:]
    chunks = []
    for p in prompts:
        chunks.append(PrefillChunk(p, 0, engine.allocator.allocate(engine.spec.blocks_for_tokens(len(p)))))
    logits = engine.runner.prefill(chunks, all_logits=True)  # one packed batch of three prompts
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0]
        ours = logits[start : start + len(p)]
        start += len(p)
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-4


def test_chunked_prefill_matches_whole_prefill(model_dir):
    engine = LLMEngine(model_dir, dtype="float32")
    prompt = _prompts(2)[-1]
    blocks = engine.allocator.allocate(engine.spec.blocks_for_tokens(len(prompt)))
    whole = engine.runner.prefill([PrefillChunk(prompt, 0, blocks)], all_logits=True)
    kv_whole = engine.runner.kv_cache.clone()
    engine.runner.kv_cache.zero_()
    parts = []
    for s in range(0, len(prompt), 37):  # chunk boundaries that don't align with blocks
        parts.append(engine.runner.prefill([PrefillChunk(prompt[s : s + 37], s, blocks)], all_logits=True))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(engine.runner.kv_cache, kv_whole, rtol=1e-4, atol=1e-4)
