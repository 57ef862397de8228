import pytest
import torch

from cluster.errors import InvalidRequestError
from cluster.sampling.sampler import SamplingTensors, sample, uniform_noise
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


def test_uniform_noise_is_in_the_open_unit_interval():
    u = uniform_noise(torch.tensor([0, 2**62]), torch.tensor([0, 123456]), 100_000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(temperature="hot"),
                                    dict(top_p=0.0), dict(top_k=-2), dict(seed=-1), dict(stop=("",)),
                                    dict(stop=tuple("x" * 17)), dict(min_tokens=99, max_tokens=4)])
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
