"""Prefix caching on the fused Triton path (GPU): a prompt whose prefix is cached is prefilled by the
packed paged attention kernel over the cached blocks plus its new tokens, and greedy output equals
caching off, on every test checkpoint (Mistral's sliding window crossed by the cached prefix). The
kernel itself is checked against the reference with cached prefixes on CPU too
(tests/cluster/kernels/test_kernel_prefill_attention.py); the engine-level path on CPU is
tests/cluster/engine/test_prefix_caching.py."""

import random

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["demo_model_dir", "qwen2_model_dir", "mistral_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def test_cached_prefix_through_the_packed_kernel_is_exact(model_dir):
    rng = random.Random(11)
    system = [0] + [rng.randrange(5, 500) for _ in range(300)]  # 18 full blocks: past the 96-token window and a 128-query tile
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    users = [[[rng.randrange(5, 500) for _ in range(5 + 7 * i + turn)] for turn in range(3)] for i in range(3)]

    def run(enable: bool):
        engine = LLMEngine(model_dir, dtype="float32", device="cuda", attention_backend="triton",
                           enable_prefix_caching=enable)
        history = [list(system) for _ in users]
        outs = []
        for turn in range(3):
            prompts = [h + u[turn] for h, u in zip(history, users)]
            got = engine.generate(prompts, params)
            outs.append([o.token_ids for o in got])
            history = [p + list(o.token_ids) for p, o in zip(prompts, got)]
        return outs, engine.allocator.stats

    ref, _ = run(False)
    got, stats = run(True)
    assert got == ref
    assert stats.hits >= 3 * 2 * (len(system) // 16) * 16  # turns 2 and 3 found every earlier full block
    torch.cuda.synchronize()
