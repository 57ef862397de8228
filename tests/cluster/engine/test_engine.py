import pytest

from cluster.engine.engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.sampling.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The sea is wide", "A decode step launches hundreds of small kernels " * 2, "x"]


def test_preemption_and_chunked_prefill_do_not_change_greedy_output(demo_model_dir):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(demo_model_dir).generate(PROMPTS, params)
    # 29 usable blocks of 4 tokens cannot hold all four sequences at once: the engine must preempt.
    tight = LLMEngine(demo_model_dir, block_size=4, num_blocks=30, max_prefill_tokens=16)
    seqs = [tight.add_request(p, params) for p in PROMPTS]
    preempted = 0
    while tight.has_work():
        before = len(tight.running)
        finished = tight.step()
        preempted += max(0, before - len(tight.running) - len(finished))
    out = [tight.output_of(s) for s in seqs]
    assert preempted > 0
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert tight.allocator.num_used == 0


def test_seeded_sampling_is_reproducible_across_batches(demo_model_dir):
    engine = LLMEngine(demo_model_dir)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([PROMPTS[0]], p)[0]
    batched = engine.generate(PROMPTS, [p] + [SamplingParams(max_tokens=5, temperature=1.0)] * 3)[0]
    assert alone.token_ids == batched.token_ids


def test_stops(demo_model_dir):
    engine = LLMEngine(demo_model_dir)
    greedy = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 16
    stop_tok = greedy.token_ids[3]
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop_tok,)))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok and len(out.token_ids) <= 4
    stop_str = greedy.text[len(greedy.text) // 2 :][:3]
    if stop_str.strip():
        out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.0, stop=(stop_str,), ignore_eos=True))[0]
        assert out.finish_reason == "stop" and stop_str not in out.text


def test_bad_requests(demo_model_dir):
    engine = LLMEngine(demo_model_dir)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.add_request("hi", SamplingParams(max_tokens=10_000))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([0, 10**6], SamplingParams())
