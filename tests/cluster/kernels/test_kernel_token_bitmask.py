"""The grammar-mask kernel against its torch reference (Triton's interpreter on CPU)."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster import kernels  # noqa: E402
from cluster.kernels import reference, token_bitmask  # noqa: E402
from cluster.sampling.sampling_state import bitmask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V = 9000  # three blocks of the kernel, not a multiple of 32


def _masks(g, rows):
    allowed = [sorted(set(torch.randperm(V, generator=g)[: 1 + 997 * r].tolist()) | {V - 1}) for r in range(rows)]
    words = (V + 31) // 32
    table = torch.stack([torch.from_numpy(bitmask(a, words)) for a in allowed]).to(DEVICE)
    return allowed, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_and_leaves_unconstrained_rows_untouched(dtype):
    g = torch.Generator().manual_seed(0)
    allowed, table = _masks(g, 3)
    # Rows: unconstrained, mask 2, mask 0, unconstrained, mask 0 again (two rows may share one).
    row_mask = torch.tensor([-1, 2, 0, -1, 0], dtype=torch.int32, device=DEVICE)
    logits = (3 * torch.randn(5, V, generator=g)).to(DEVICE, dtype)
    logits[3, 7] = float("nan")  # untouched too
    want = reference.apply_token_bitmask(logits.clone(), row_mask, table)
    got = token_bitmask.apply_token_bitmask(logits.clone(), row_mask, table)
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    for r in (0, 3):  # bit for bit
        assert torch.equal(torch.nan_to_num(got[r]), torch.nan_to_num(logits[r]))
    for r, m in ((1, 2), (2, 0), (4, 0)):
        finite = torch.isfinite(got[r].float()).nonzero().flatten().tolist()
        assert finite == allowed[m]
        assert torch.equal(got[r, allowed[m]], logits[r, allowed[m]])  # allowed logits keep their value


def test_strided_rows_and_the_dispatch():
    """A row stride wider than the vocabulary (a slice of a static buffer) and kernels.apply_token_bitmask."""
    g = torch.Generator().manual_seed(1)
    allowed, table = _masks(g, 2)
    buf = torch.randn(4, V + 100, generator=g).to(DEVICE)
    logits = buf[:3, :V]
    row_mask = torch.tensor([1, -1, 0, 1], dtype=torch.int32, device=DEVICE)  # longer than the batch
    want = reference.apply_token_bitmask(logits.clone(), row_mask, table)
    with kernels.use_kernels(True):
        kernels.apply_token_bitmask(logits, row_mask, table)
    assert torch.equal(logits, want)
    assert torch.isfinite(buf[:, V:]).all() and torch.isfinite(buf[3]).all()  # nothing outside the view
