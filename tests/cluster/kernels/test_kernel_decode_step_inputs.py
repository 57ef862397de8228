"""The decode-step input kernel (unpacking the one per-step host-to-device buffer) against its reference."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import reference  # noqa: E402
from cluster.kernels.decode_step_inputs import decode_inputs  # noqa: E402
from cluster.kernels.step_layout import DecodeStepLayout  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(rows, width, block_size, device, seed):
    g = torch.Generator().manual_seed(seed)
    lay = DecodeStepLayout(rows)
    packed = torch.zeros(lay.words(width) + 5, dtype=torch.int32)  # a longer buffer, as the runner's is
    positions = torch.randint(0, width * block_size, (rows,), generator=g)
    prev = torch.randint(-1, 6, (rows,), generator=g)
    packed[lay.host_ids : lay.host_ids + rows] = torch.randint(0, 1000, (rows,), generator=g).int()
    packed[lay.prev_row : lay.prev_row + rows] = prev.int()
    packed[lay.positions : lay.positions + rows] = positions.int()
    packed[lay.width] = width
    packed[lay.tables : lay.tables + rows * width] = torch.randint(1, 500, (rows * width,), generator=g).int()
    return packed.to(device)


def _outputs(max_rows, max_blocks, device):
    nan_i64 = dict(dtype=torch.int64, device=device)
    return dict(ids=torch.full((max_rows,), -9, **nan_i64), positions=torch.full((max_rows,), -9, **nan_i64),
                slots=torch.full((max_rows,), -9, **nan_i64),
                context_lens=torch.full((max_rows,), -9, dtype=torch.int32, device=device),
                next_positions=torch.full((max_rows,), -9, **nan_i64),
                tables=torch.full((max_rows, max_blocks), -9, dtype=torch.int32, device=device))


@pytest.mark.parametrize("rows,width", [(1, 1), (5, 3), (13, 40)])
def test_matches_reference(rows, width):
    _check(rows, width, DEVICE)


def _check(rows, width, device):
    block_size, max_rows, max_blocks = 16, rows + 3, width + 7
    packed = _packed(rows, width, block_size, device, seed=rows)
    out_tokens = torch.arange(100, 100 + max_rows, dtype=torch.int64, device=device)
    got, want = _outputs(max_rows, max_blocks, device), _outputs(max_rows, max_blocks, device)
    decode_inputs(packed, rows, out_tokens, **got, block_size=block_size)
    reference.decode_inputs(packed, rows, out_tokens, **want, block_size=block_size)
    for name in got:
        assert torch.equal(got[name], want[name]), name
    assert (got["ids"][rows:] == -9).all() and (got["tables"][:, width:] == -9).all()  # nothing else written
    assert (got["tables"][rows:] == -9).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", [(1, 2048), (64, 64), (256, 257)])
def test_matches_reference_on_gpu(rows, width):
    _check(rows, width, "cuda")
