"""The logits-processing, state-update and logprobs kernels against their torch references."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import logits_processing, logprobs, reference  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.sampling.sampling_state import SamplingState  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V = 20000  # three chunks: bias entries and bad words land in every one

PARAMS = [
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.7),
    SamplingParams(logit_bias={3: 5.0, 9000: -100.0, 19999: 2.5, 17000: 1.0}, presence_penalty=1.0),
    SamplingParams(allowed_token_ids=list(range(0, V, 7)) + [8193], logit_bias={8193: -3.0, 15: 1.0}),
    SamplingParams(bad_words_token_ids=[(11,), (4, 12001), (5, 4, 8200), (1, 2, 3, 9)], repetition_penalty=0.8),
    SamplingParams(logprobs=5),  # a slot, nothing to process
]
PROMPTS = [[1, 2, 3, 4, 1], [7, 7, 8], [14, 21], [11, 12, 13], [1]]
OUTPUTS = [[5, 5, 9000, 3], [3, 17000, 3], [8193], [9, 5, 4], []]


def _state():
    state = SamplingState.allocate(8, V, DEVICE)
    slots = [6, 0, 3, 5, 1]  # not the row order: rows name their slot
    state.init_slots(slots, PARAMS, PROMPTS, OUTPUTS)
    return state, slots


def _row_slots(slots):
    # rows: a plain row, then each slotted sequence, another plain row
    return torch.tensor([-1, *slots, -1], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_process_logits_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    state, slots = _state()
    rows = _row_slots(slots)
    logits = (4 * torch.randn(len(rows), V, generator=g)).to(DEVICE, dtype)
    logits[:, 4] = 0.0  # a zero logit under the repetition penalty
    got = logits_processing.process_logits(logits, rows, state)
    want = reference.process_logits(logits, rows, state)
    assert torch.equal(got, want)
    assert torch.equal(got[0], logits[0].float()) and torch.equal(got[-1], logits[-1].float())  # plain rows
    # Spot checks of the semantics on the reference's output.
    assert got[4, 11] == float("-inf")  # a one-token bad word
    assert got[4, 12001] == float("-inf")  # (4, 12001): 4 was the last token generated
    assert got[4, 8200] == float("-inf")  # (5, 4, 8200): 5, 4 were
    assert got[4, 9] != float("-inf")  # (1, 2, 3, 9): 1, 2, 3 were not
    allowed = torch.isfinite(got[3])
    assert allowed.sum() == len(set(range(0, V, 7)) | {8193}) and allowed[8193] and not allowed[15]


def test_state_update_matches_reference():
    state, slots = _state()
    ref = SamplingState(**{k: v.clone() for k, v in vars(state).items()})
    rows = _row_slots(slots)
    tokens = torch.tensor([77, 12, 13, 14, 15, 16, 17], dtype=torch.int64, device=DEVICE)
    logits_processing.update_sampling_state(rows, tokens, state)
    reference.update_sampling_state(rows, tokens, ref)
    for name, t in vars(state).items():
        assert torch.equal(t, getattr(ref, name)), name
    assert state.counts[slots[0], 12] == 1 and state.history[slots[3], -2:].tolist() == [4, 15]


def test_init_slots_counts_and_history():
    state, slots = _state()
    assert state.counts[slots[0], 5] == 2 and state.counts[slots[0], 9000] == 1 and state.counts[slots[0]].sum() == 4
    assert state.history[slots[3], -3:].tolist() == [9, 5, 4]
    assert state.iparams[slots[3], 3] == 3  # tokens generated
    # a slot taken again is rewritten whole
    state.init_slots([slots[0]], [SamplingParams(frequency_penalty=1.0)], [[2]], [[6]])
    assert state.counts[slots[0]].sum() == 1 and state.counts[slots[0], 6] == 1


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_token_logprobs_match_reference(k):
    g = torch.Generator().manual_seed(k)
    logits = (3 * torch.randn(6, V, generator=g)).to(DEVICE)
    tokens = torch.randint(0, V, (6,), generator=g).to(DEVICE)
    lp, ids, top = logprobs.token_logprobs(logits, tokens, k)
    want_lp, want_ids, want_top = reference.token_logprobs(logits, tokens, k)
    assert torch.allclose(lp, want_lp, atol=1e-5, rtol=1e-5)
    assert ids.tolist() == want_ids.tolist()
    assert torch.allclose(top, want_top, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_features_step_replays_in_a_cuda_graph():
    from cluster.sampling.sampler import SamplingTensors, StepOutputs, sample_step

    state, slots = _state()
    rows = _row_slots(slots)
    params = [SamplingParams(temperature=0.0)] + PARAMS + [SamplingParams(temperature=0.7, top_k=20, min_p=0.05)]
    st = SamplingTensors.from_params(params, list(range(len(params))), "cuda")
    pos = torch.arange(len(params), device="cuda") + 5
    logits = (3 * torch.randn(len(params), 128256, device="cuda")).to(torch.bfloat16)
    big = SamplingState.allocate(8, 128256, "cuda")
    big.init_slots(slots, PARAMS, PROMPTS, OUTPUTS)
    ref_state = SamplingState(**{k: v.clone() for k, v in vars(big).items()})
    out = StepOutputs.allocate(len(params), 128256, "cuda")
    sample_step(logits, st, pos, rows, big, out)  # warm-up (compiles), then undo its state update
    torch.cuda.synchronize()
    for k, v in vars(ref_state).items():
        getattr(big, k).copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_step(logits, st, pos, rows, big, out)
    for step in range(3):
        logits.copy_((3 * torch.randn_like(logits, dtype=torch.float32)).to(torch.bfloat16))
        graph.replay()
        eager = StepOutputs.allocate(len(params), 128256, "cuda")
        sample_step(logits, st, pos, rows, ref_state, eager)
        assert out.tokens.tolist() == eager.tokens.tolist()
        assert torch.equal(out.processed, eager.processed)
        assert torch.allclose(out.logprob, eager.logprob) and torch.equal(out.top_ids, eager.top_ids)
        for k in vars(big):
            assert torch.equal(getattr(big, k), getattr(ref_state, k)), k
        pos.add_(1)
