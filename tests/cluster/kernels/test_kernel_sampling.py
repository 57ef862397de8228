"""The one-pass sampling kernel against its torch reference: same hash, same kept set, same tokens."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import reference  # noqa: E402
from cluster.kernels.sampling import sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (temperature, top_k, top_p) per row: greedy, plain sampling, each filter, both, the edge values.
ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 40, 0.9), (1.0, 1, 1.0),
        (0.9, 10_000_000, 1.0), (2.0, 0, 0.05), (0.5, 3, 0.999), (1.0, 0, 1.0)]


def _params(rows, device, seed0=0):
    t = torch.tensor([r[0] for r in rows], dtype=torch.float32, device=device)
    k = torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device)
    p = torch.tensor([r[2] for r in rows], dtype=torch.float32, device=device)
    seeds = torch.tensor([seed0 + 977 * i + (i % 2) * 2**62 for i in range(len(rows))], dtype=torch.int64, device=device)
    positions = torch.arange(len(rows), device=device) * 31 + 5
    return t, k, p, seeds, positions


def _both(logits, rows, seed0=0):
    t, k, p, seeds, pos = _params(rows, logits.device, seed0)
    out = torch.full((len(rows),), -7, dtype=torch.int64, device=logits.device)  # poisoned
    got = sample(logits, t, k, p, seeds, pos, out=out)
    want = reference.sample(logits, t, k, p, seeds, pos)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(len(ROWS), 3001, generator=g)).to(device=DEVICE, dtype=dtype)
    got, want = _both(logits, ROWS)
    assert got.tolist() == want.tolist()
    assert got[0] == logits[0].float().argmax() and got[5] == logits[5].float().argmax()  # greedy, top_k=1


# Under the interpreter the smallest batches that take every branch (each kind of row once); the
# larger ones (each kind of row with more seeds) on a GPU.
ONCE_ON_CPU = [1, pytest.param(3, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("copies", ONCE_ON_CPU)
def test_ties_are_ranked_by_token_id_like_the_reference(copies):
    # Coarse logits: many exact ties at every rank, the kept-set boundary included.
    g = torch.Generator().manual_seed(1)
    logits = (torch.randint(-6, 7, (len(ROWS) * copies, 700), generator=g).float() / 2).to(DEVICE)
    rows = ROWS * copies
    got, want = _both(logits, rows, seed0=5)
    assert got.tolist() == want.tolist()
    for i, (_, k, p) in enumerate(rows):
        if k == 1:
            assert got[i] == logits[i].argmax()  # the first of the tied maxima


@pytest.mark.parametrize("copies", [1, pytest.param(2, marks=pytest.mark.gpu)])
def test_top_k_on_flat_logits_matches_reference(copies):
    # Nearly flat rows: the first Gumbel winner is almost never in the top k, so the kernel brackets
    # the k-th value with pivots and then narrows the candidates (the slow path, exercised here).
    g = torch.Generator().manual_seed(3)
    rows = [(1.0, 5, 1.0), (0.8, 50, 0.9), (1.0, 2, 1.0), (1.0, 300, 0.5)] * copies
    logits = (0.5 * torch.randn(len(rows), 20000, generator=g)).to(DEVICE)
    got, want = _both(logits, rows, seed0=11)
    assert got.tolist() == want.tolist()
    for i, (_, k, _) in enumerate(rows):
        assert got[i] in logits[i].topk(k).indices


def test_uncertain_tokens_resolved_exactly_and_past_the_list_by_the_serial_search():
    """Rows whose first winner is not surely kept: their uncertain tokens (the bins between surely kept
    and surely cut) are ranked exactly (a handful: top-k on flat rows, several chunks); a row with more
    than CAP of them (an almost constant row's top-p boundary) takes the serial exact search. Both
    equal the reference."""
    from cluster.kernels.sampling import CAP, CHUNK

    g = torch.Generator().manual_seed(7)
    vocab = 2 * CHUNK + 1234
    rows = [(1.0, 5, 1.0), (0.8, 50, 0.9), (1.0, 300, 0.5), (1.0, 2, 1.0), (1.0, 0, 0.5), (1.0, 3 * CAP, 1.0)]
    logits = (0.5 * torch.randn(len(rows), vocab, generator=g))
    logits[4:] = 1.0 + 0.001 * torch.randn(2, vocab, generator=g)  # boundaries in one crowded bin
    got, want = _both(logits.to(DEVICE), rows, seed0=21)
    assert got.tolist() == want.tolist()


def test_rows_of_nan_or_inf_logits_end():
    # Degenerate rows must not hang the kernel (inside a CUDA graph that would hang the worker).
    logits = torch.randn(4, 3000).to(DEVICE)
    logits[0] = float("nan")
    logits[1, 7] = float("inf")
    logits[2, :5] = float("inf")
    rows = [(1.0, 5, 0.9)] * 4
    t, k, p, seeds, pos = _params(rows, DEVICE)
    out = sample(logits, t, k, p, seeds, pos)
    assert out[1] == 7 and 0 <= out[2] < 5 and 0 <= out[0] < 3000


def test_a_row_samples_the_same_token_in_any_batch():
    g = torch.Generator().manual_seed(2)
    logits = (2 * torch.randn(len(ROWS), 2000, generator=g)).to(DEVICE)
    t, k, p, seeds, pos = _params(ROWS, DEVICE)
    together = sample(logits, t, k, p, seeds, pos)
    for i in (1, 4, 8):
        alone = sample(logits[i : i + 1], t[i : i + 1], k[i : i + 1], p[i : i + 1], seeds[i : i + 1], pos[i : i + 1])
        assert alone[0] == together[i]
    moved = sample(logits, t, k, p, seeds, pos + 1)  # the next position draws other noise
    assert (moved != together)[t > 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_matches_reference_full_vocabulary_on_gpu(batch):
    g = torch.Generator().manual_seed(batch)
    logits = (4 * torch.randn(batch, 128256, generator=g)).to("cuda", torch.bfloat16)
    rows = (ROWS * (batch // len(ROWS) + 1))[:batch]
    got, want = _both(logits, rows, seed0=batch)
    assert got.tolist() == want.tolist()


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    logits = (3 * torch.randn(len(ROWS), 128256, device="cuda")).to(torch.bfloat16)
    t, k, p, seeds, pos = _params(ROWS, "cuda")
    out = sample(logits, t, k, p, seeds, pos)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(logits, t, k, p, seeds, pos, out=out)
    for shift in range(3):
        pos.add_(shift)
        logits.copy_(3 * torch.randn_like(logits, dtype=torch.float32))
        graph.replay()
        assert out.tolist() == reference.sample(logits, t, k, p, seeds, pos).tolist()


def test_a_banned_token_with_the_top_noise_is_not_drawn():
    """(seed 6181, position 7, token 128) hashes to the top 24-bit value, whose u rounded to 1.0: a
    -inf logit plus +inf noise scored NaN. The kernel clamps u as the reference does."""
    logits = torch.zeros(2, 512, device=DEVICE)
    logits[:, 128] = float("-inf")
    t = torch.tensor([1.0, 0.5], device=DEVICE)
    k = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    p = torch.ones(2, device=DEVICE)
    seeds = torch.tensor([6181, 6181], dtype=torch.int64, device=DEVICE)
    pos = torch.tensor([7, 7], device=DEVICE)
    got = sample(logits, t, k, p, seeds, pos)
    want = reference.sample(logits, t, k, p, seeds, pos)
    assert got.tolist() == want.tolist() and 128 not in got.tolist()
