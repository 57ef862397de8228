"""The graph runner's grammar masks, on CPU (the eager path runs what the graphs capture): constrained
rows sample only what their grammar allows, free rows sample as without them, logprobs stay the
model's, the kernel path equals the reference path, and a constrained sequence keeps its
sampling-state slot across the steps it skips."""

import random

import pytest
import torch

from cluster.kv.kv_cache import KVCacheSpec
from cluster.model.loader import load_model
from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.structured import GrammarCompiler, StructuredOutput
from cluster.text.tokenizer import load_tokenizer
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeRow


@pytest.fixture(scope="module")
def setup(demo_model_dir):
    model = load_model(demo_model_dir, dtype="float32")
    spec = KVCacheSpec.for_model(model.cfg, 16, 64, torch.float32)
    runner = ModelRunner(model, spec, "cpu")
    tok = load_tokenizer(demo_model_dir)
    grammars = GrammarCompiler(lambda: tok, model.cfg.vocab_size, model.cfg.eos_token_ids)
    yield model, spec, runner, tok, grammars
    grammars.close()


def make_seqs(spec, runner, params, grammars, specs):
    rng = random.Random(0)
    seqs, blocks = [], 1
    for i, (p, so) in enumerate(zip(params, specs)):
        n = 6 + 5 * i
        table = list(range(blocks, blocks + spec.blocks_for_tokens(n + 16)))
        blocks += len(table)
        prompt = [rng.randrange(5, 500) for _ in range(n)]
        runner.prefill([PrefillChunk(prompt, 0, table)])
        s = Sequence(f"s{i}", prompt, p, seed=10 + i)
        s.block_table, s.status = table, SequenceStatus.RUNNING
        if so is not None:
            s.grammar = grammars.grammar_for(so, s.request_id)
            # Until its own deadline: the first compile starts the compile processes (they import torch
            # and xgrammar), a minute or more in the other test stream (nice 10) on a busy machine.
            assert s.grammar.wait(), s.grammar.error
        seqs.append(s)
    return seqs


def rows_of(seqs):
    return [DecodeRow(s, s.last_token_id, -1, s.num_tokens - 1) for s in seqs]


def test_constrained_rows_obey_their_grammar_and_free_rows_do_not_notice(setup):
    model, spec, runner, tok, grammars = setup
    digits = StructuredOutput.regex("[0-9]{4}")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0, logprobs=1)]
    seqs = make_seqs(spec, runner, params, grammars, [None, digits, digits, digits])
    kv0 = runner.kv_cache.clone()
    gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=4, max_blocks_per_seq=16)
    h = gr.launch(rows_of(seqs))
    tokens, (lp, _, _) = h.tokens(), h.logprobs()
    assert h.info.constrained == 3 and h.info.features
    assert all(tok.decode([t]).isdigit() for t in tokens[1:]), [tok.decode([t]) for t in tokens]
    runner.kv_cache.copy_(kv0)
    logits = runner.decode([s.last_token_id for s in seqs], [s.num_tokens - 1 for s in seqs],
                           [s.block_table for s in seqs])
    assert tokens[0] == int(logits[0].argmax())  # the free row, as without masks
    raw = torch.log_softmax(logits[3].float(), -1)[tokens[3]]
    assert lp[3] == pytest.approx(float(raw), abs=1e-5)  # the model's logprob, not the masked one
    assert tokens[3] != int(logits[3].argmax())  # (the model would not have said a digit)


def test_the_kernel_path_masks_like_the_reference_path(setup, demo_model_dir):
    from triton_interpreter import use_interpreter_without_cuda

    interpreted = use_interpreter_without_cuda()
    from cluster import kernels

    model, spec, runner, tok, grammars = setup
    if not interpreted:  # with CUDA the kernels compile natively and take only CUDA tensors
        model = load_model(demo_model_dir, dtype="float32", device="cuda")
        spec = KVCacheSpec.for_model(model.cfg, 16, 64, torch.float32)
        runner = ModelRunner(model, spec, "cuda")
    so = StructuredOutput.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}})
    params = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, presence_penalty=1.0)]
    kv0 = runner.kv_cache.clone()
    out = {}
    for fused in (False, True):
        runner.kv_cache.copy_(kv0)
        seqs = make_seqs(spec, runner, params, grammars, [so, None, so])
        gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=4, max_blocks_per_seq=16)
        with kernels.use_kernels(fused):
            out[fused] = gr.launch(rows_of(seqs)).tokens()
    assert out[True] == out[False] and tok.decode([out[True][0]]) == "{"


def test_a_constrained_sequence_keeps_its_slot_across_the_steps_it_skips(setup):
    model, spec, runner, tok, grammars = setup
    so = StructuredOutput.regex("[a-z]+")
    seqs = make_seqs(spec, runner, [SamplingParams(temperature=0.0, repetition_penalty=1.2),
                                    SamplingParams(temperature=0.0, logprobs=0)], grammars, [so, None])
    c, u = seqs
    gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=4, max_blocks_per_seq=16)
    gr.launch(rows_of(seqs)).tokens()
    slot = gr._slot_of[id(c)][1]
    gr.launch(rows_of([u])).tokens()  # c skips a step: its token was in flight
    assert gr._slot_of[id(c)][1] == slot
    c.status = SequenceStatus.FINISHED
    gr.launch(rows_of([u])).tokens()
    assert id(c) not in gr._slot_of


def test_a_runner_without_grammar_masks_refuses_constrained_rows(setup):
    model, spec, runner, tok, grammars = setup
    seqs = make_seqs(spec, runner, [SamplingParams(temperature=0.0)], grammars, [StructuredOutput.regex("a")])
    gr = BucketedGraphRunner(model, runner.kv_cache, spec.block_size, max_num_seqs=2, max_blocks_per_seq=16,
                             grammar_masks=False)
    with pytest.raises(ValueError, match="grammar masks"):
        gr.launch(rows_of(seqs))


@pytest.mark.gpu
def test_graph_replay_masks_like_eager_on_the_gpu(demo_model_dir):
    """The captured graphs (plain and features variants) apply the masks as the eager step does, over
    steps whose masks change with the tokens."""
    model = load_model(demo_model_dir, dtype="float32", device="cuda", attention_backend="triton")
    spec = KVCacheSpec.for_model(model.cfg, 16, 256, torch.float32)
    runner = ModelRunner(model, spec, "cuda")
    tok = load_tokenizer(demo_model_dir)
    grammars = GrammarCompiler(lambda: tok, model.cfg.vocab_size, model.cfg.eos_token_ids)
    so = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"},
                                                                        "s": {"type": "string", "maxLength": 5}},
                                       "required": ["n", "s"]})  # longer than the 6 steps below
    graphs = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=8, max_blocks_per_seq=16, buckets=(4, 8))
    eager = BucketedGraphRunner(model, runner.kv_cache, 16, max_num_seqs=8, max_blocks_per_seq=16, buckets=(4, 8),
                                use_cuda_graph=False)
    graphs.capture(progress=False)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0.0, ignore_eos=True), SamplingParams(temperature=0.7, seed=4, logprobs=1)]
    kv0 = runner.kv_cache.clone()
    out = {}
    for name, gr in (("graph", graphs), ("eager", eager)):
        runner.kv_cache.copy_(kv0)
        seqs = make_seqs(spec, runner, params, grammars, [so, so, None, so])
        steps = []
        for _ in range(6):
            h = gr.launch(rows_of(seqs))
            assert h.info.graph == (name == "graph")
            toks = h.tokens()
            for s, t in zip(seqs, toks):
                assert s.append_token(t) is None
            steps.append(toks)
        out[name] = steps
    assert out["graph"] == out["eager"]
    grammars.close()
