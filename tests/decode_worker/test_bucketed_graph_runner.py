"""Padding (the bucket rule itself: tests/cluster/engine/test_graph_buckets.py). On CPU the runner runs eagerly
with the same padding as the graphs."""

import random

import pytest
import torch

from cluster.kv.kv_blocks import NULL_BLOCK
from cluster.kv.kv_cache import KVCacheSpec
from cluster.model.loader import load_model
from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeRow


@pytest.fixture(scope="module")
def setup(demo_model_dir):
    model = load_model(demo_model_dir, dtype="float32")
    spec = KVCacheSpec.for_model(model.cfg, 16, 64, torch.float32)
    runner = ModelRunner(model, spec, "cpu")
    return model, spec, runner


def test_padded_rows_write_only_the_null_block_and_match_unpadded_decode(setup):
    model, spec, runner = setup
    rng = random.Random(0)
    gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=8, max_blocks_per_seq=16,
                             buckets=(1, 2, 4, 8))
    lens = [5, 20, 33]
    seqs, blocks = [], 1
    for i, n in enumerate(lens):
        table = list(range(blocks, blocks + spec.blocks_for_tokens(n + 1)))
        blocks += len(table)
        prompt = [rng.randrange(5, 500) for _ in range(n)]
        runner.prefill([PrefillChunk(prompt, 0, table)])
        s = Sequence(f"r{i}", prompt, SamplingParams(temperature=0.0), seed=0)
        s.block_table = table
        seqs.append(s)
    kv_before = runner.kv_cache.clone()
    rows = [DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in seqs]
    h = gr.launch(rows)
    assert (h.info.batch_size, h.info.bucket, h.info.graph) == (3, 4, False)
    tokens = h.tokens()
    # Only the three rows' own slots and the NULL block changed.
    changed = (runner.kv_cache != kv_before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    touched = {(b, o) for b, o in changed.nonzero().tolist()}
    expected = {(s.block_table[(s.num_tokens - 1) // 16], (s.num_tokens - 1) % 16) for s in seqs}
    assert touched - {(NULL_BLOCK, 0)} == expected
    # Same tokens as an unpadded eager decode over the same KV.
    runner.kv_cache.copy_(kv_before)
    ref = runner.decode([s.last_token_id for s in seqs], [s.num_tokens - 1 for s in seqs], [s.block_table for s in seqs])
    assert tokens == ref.argmax(-1).tolist()
    # The next step takes its input tokens from the device (prev_row), not from the host.
    for s, t in zip(seqs, tokens):
        s.output_token_ids.append(t)
    runner.kv_cache.copy_(kv_before)
    gr.launch(rows)  # rewrite the same KV, leaving out_tokens as before
    rows2 = [DecodeRow(s, 0, i, s.num_tokens - 1) for i, s in enumerate(seqs)]
    tok2 = gr.launch(rows2).tokens()
    ref2 = runner.decode(tokens, [s.num_tokens - 1 for s in seqs], [s.block_table for s in seqs])
    assert tok2 == ref2.argmax(-1).tolist()


def test_a_features_batch_pads_to_the_features_variants_buckets(setup):
    """A batch where some row asks for logprobs (or penalties) runs the features variant, padded by
    cluster.engine.graph_buckets.feature_bucket_sizes; the same rows without it pad by the plain rule."""
    model, spec, runner = setup
    gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=8, max_blocks_per_seq=16,
                             buckets=(1, 3, 6, 8))
    assert gr.feature_buckets == [1, 8]
    rng = random.Random(5)
    plain, feat, blocks = [], [], 1
    for i, n in enumerate((4, 9, 17)):
        table = list(range(blocks, blocks + spec.blocks_for_tokens(n + 1)))
        blocks += len(table)
        prompt = [rng.randrange(5, 500) for _ in range(n)]
        runner.prefill([PrefillChunk(prompt, 0, table)])
        for out, params in ((plain, SamplingParams(temperature=0.0)),
                            (feat, SamplingParams(temperature=0.0, logprobs=1 if i == 1 else None))):
            s = Sequence(f"r{i}-{len(out)}", prompt, params, seed=0)
            s.block_table = table
            out.append(s)
    kv0 = runner.kv_cache.clone()
    h = gr.launch([DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in plain])
    assert (h.info.bucket, h.info.features) == (3, False) and h.logprobs() is None
    greedy = h.tokens()
    runner.kv_cache.copy_(kv0)
    h = gr.launch([DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in feat])
    assert (h.info.bucket, h.info.features) == (8, True) and gr.padded_size(3, features=True) == 8
    assert h.tokens() == greedy  # greedy either way; the padding rows change nothing
    lp, ids, _ = h.logprobs()
    assert len(lp) == 3 and ids[1][0] == greedy[1]  # the greedy token is its row's most likely one


def test_kernel_path_samples_like_the_reference_path(setup):
    """The step as the GPU runs it (decode-input, rotary/KV, norm, attention and sampling kernels; on
    CPU under Triton's interpreter) against the torch references, for greedy, sampled and top-k/top-p
    rows in one batch, including a row continuing from the previous step's device-side token."""
    from triton_interpreter import use_interpreter_without_cuda

    use_interpreter_without_cuda()
    from cluster import kernels

    model, spec, runner = setup
    rng = random.Random(1)
    seqs, blocks = [], 40
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3),
              SamplingParams(temperature=1.2, top_k=7, top_p=0.8, seed=4)]
    for i, p in enumerate(params):
        n = 10 + 7 * i
        table = list(range(blocks, blocks + spec.blocks_for_tokens(n + 2)))
        blocks += len(table)
        prompt = [rng.randrange(5, 500) for _ in range(n)]
        runner.prefill([PrefillChunk(prompt, 0, table)])
        s = Sequence(f"k{i}", prompt, p, seed=100 + i)
        s.block_table = table
        seqs.append(s)
    kv0 = runner.kv_cache.clone()
    tokens = {}
    for fused in (False, True):
        runner.kv_cache.copy_(kv0)
        gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=4, max_blocks_per_seq=16)
        with kernels.use_kernels(fused):
            first = gr.launch([DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in seqs]).tokens()
            second = gr.launch([DecodeRow(s, 0, i, s.num_tokens) for i, s in enumerate(seqs)]).tokens()
        tokens[fused] = (first, second)
    assert tokens[True] == tokens[False]
