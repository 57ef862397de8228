import pytest
import torch

from cluster.errors import InvalidRequestError
from cluster.kernels import reference
from cluster.sampling.sampler import SamplingTensors, sample, sample_tokens_async, take_rows, uniform_noise
from cluster.sampling.sampling_params import SamplingParams


def _tensors(params, seeds):
    return SamplingTensors.from_params(params, seeds, "cpu")


def test_greedy_rows_take_the_argmax_whatever_the_other_rows_do():
    logits = torch.randn(4, 300)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.3)]
    out = sample(logits, _tensors(params, [1, 2, 3, 4]), torch.arange(4), True)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_1_is_greedy_and_top_k_bounds_the_support():
    logits = torch.randn(1, 100).repeat(64, 1)
    st = _tensors([SamplingParams(temperature=1.0, top_k=3)] * 64, list(range(64)))
    out = sample(logits, st, torch.zeros(64, dtype=torch.long), True)
    assert set(out.tolist()) <= set(logits[0].topk(3).indices.tolist())
    st1 = _tensors([SamplingParams(temperature=1.0, top_k=1)] * 4, [0, 1, 2, 3])
    assert (sample(logits[:4], st1, torch.zeros(4, dtype=torch.long), True) == logits[0].argmax()).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(200, 1)
    st = _tensors([SamplingParams(temperature=1.0, top_p=0.7)] * 200, list(range(200)))
    out = sample(logits, st, torch.zeros(200, dtype=torch.long), True)
    assert set(out.tolist()) == {0, 1}


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, 500)
    p = SamplingParams(temperature=1.0)
    a = sample(logits, _tensors([p] * 3, [7, 8, 9]), torch.tensor([10, 10, 10]), False)
    b = sample(logits[1:2], _tensors([p], [8]), torch.tensor([10]), False)
    assert a[1] == b[0]
    assert not torch.equal(uniform_noise(torch.tensor([7]), torch.tensor([10]), 50),
                           uniform_noise(torch.tensor([7]), torch.tensor([11]), 50))


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 4000
    st = _tensors([SamplingParams(temperature=1.0)] * n, list(range(n)))
    out = sample(probs.log()[None].repeat(n, 1), st, torch.zeros(n, dtype=torch.long), False)
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


# (seed, position, token) whose 24 hashed bits are all ones: before MAX_UNIFORM its u rounded to 1.0.
TOP_NOISE = (6181, 7, 128)


def test_uniform_noise_is_in_the_open_unit_interval():
    u = uniform_noise(torch.tensor([0, 2**62]), torch.tensor([0, 123456]), 100_000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    seed, pos, token = TOP_NOISE
    top = uniform_noise(torch.tensor([seed]), torch.tensor([pos]), token + 1)[0, token]
    assert top.item() == reference.MAX_UNIFORM < 1


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_a_banned_token_is_never_drawn_even_with_the_top_noise(temperature):
    """A token at -inf (a grammar's mask, allowed_token_ids, a bad word) whose noise is the largest the
    hash gives: it scored NaN (-inf + inf) and argmax picked it; now its score is -inf."""
    seed, pos, token = TOP_NOISE
    logits = torch.zeros(1, 512)
    logits[0, token] = float("-inf")
    got = reference.sample(logits, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]),
                           torch.tensor([seed]), torch.tensor([pos]))
    assert got.item() != token
    # The same through the grammar path: only two tokens allowed, the banned one has the top noise.
    logits[0, token] = 5.0
    allowed = torch.full((1, 512), float("-inf"))
    allowed[0, [3, 4]] = 0.0
    got = reference.sample(logits + allowed, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]),
                           torch.tensor([seed]), torch.tensor([pos]))
    assert got.item() in (3, 4)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(temperature="hot"),
                                    dict(top_p=0.0), dict(top_k=-2), dict(seed=-1), dict(stop=("",)),
                                    dict(stop=tuple("x" * 17)), dict(min_tokens=99, max_tokens=4)])
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_take_rows_selects_rows_and_keeps_the_tensor_when_all_rows_in_order():
    t = torch.arange(12.0).view(4, 3)
    assert take_rows(t, [0, 1, 2, 3]) is t
    assert torch.equal(take_rows(t, [3, 1]), t[[3, 1]])


def test_a_host_draw_matches_the_plain_draw_of_its_rows():
    """sample_tokens_async over take_rows: the same tokens as `sample` over the rows picked by hand
    (the prefill worker's and the local prefill's draw of the rows a pass completed)."""
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3, top_k=7)]
    got, _ = sample_tokens_async(take_rows(logits, [4, 1]), params, [11, 12], [7, 9]).result()
    want = sample(logits[[4, 1]], _tensors(params, [11, 12]), torch.tensor([7, 9]), True)
    assert got == want.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_queued_draw_does_not_wait_for_the_work_ahead_of_it():
    """The first-token draw is queued right behind a prefill pass (prefill_worker.PrefillWorker.step):
    uploading its parameters and row index must not sync the host with the stream, or the host work
    meant to overlap the pass would wait for it. A ~0.5 s device sleep stands for the pass."""
    logits = torch.randn(3, 1000, device="cuda")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=5, top_p=0.9)]
    want, _ = sample_tokens_async(take_rows(logits, [2, 0]), params, [1, 2], [10, 11]).result()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # cycles: ~0.5 s at H100/H200 clocks
    drawn = sample_tokens_async(take_rows(logits, [2, 0]), params, [1, 2], [10, 11])
    assert not drawn._event.query(), "the draw's upload waited for the work queued before it"
    got, _ = drawn.result()
    assert got == want
