"""The fused block copy: its Triton kernel equals the torch reference bit for bit (on CPU under the
Triton interpreter, in a child process because TRITON_INTERPRET must be set before triton loads; on
CUDA directly), and the reference does what it says."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.transport.block_copy import copy_blocks, copy_blocks_reference


def _cases(device):
    """(dst, dst_ids, src, src_ids) covering gather, scatter, both, layer slices, dtypes and NaN bits."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, shape in [(torch.bfloat16, (3, 2, 12, 4, 2, 8)), (torch.float32, (2, 2, 9, 2, 1, 4)),
                         (torch.float16, (4, 2, 7, 16, 2, 16)), (torch.float32, (2, 2, 6, 3, 1, 3))]:
        src = torch.randn(shape, generator=g).to(dtype).to(device)
        src.view(torch.uint8)[0, 0, 1].fill_(0xFF)  # a NaN payload must travel unchanged
        n = 4
        ids = lambda k: torch.tensor(rng.sample(range(1, shape[2]), k), dtype=torch.int32, device=device)  # noqa: E731
        dst = torch.zeros(shape, dtype=dtype, device=device)
        out.append((dst, ids(n), src, ids(n)))  # cache -> cache (same-GPU transfer)
        staging = torch.zeros((shape[0], 2, n) + shape[3:], dtype=dtype, device=device)
        out.append((staging, None, src, ids(n)))  # gather into staging
        out.append((dst.clone(), ids(n), staging.clone().normal_(generator=g if device == "cpu" else None), None))  # scatter
        out.append((dst[1:].clone(), ids(n), src[1:].contiguous(), ids(n)))  # a layer range
    return out


def check_kernel_equals_reference(device: str) -> int:
    n = 0
    for dst, dst_ids, src, src_ids in _cases(device):
        want = dst.clone()
        copy_blocks_reference(want, dst_ids, src, src_ids)
        copy_blocks(dst, dst_ids, src, src_ids, use_triton=True)
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), (dst.dtype, dst.shape)
        n += 1
    return n


def test_reference_moves_exactly_the_named_blocks():
    src = torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).view(2, 2, 6, 3, 1, 1)
    dst = torch.full_like(src, -1.0)
    copy_blocks(dst, torch.tensor([5, 0]), src, torch.tensor([1, 4]))
    assert torch.equal(dst[:, :, 5], src[:, :, 1]) and torch.equal(dst[:, :, 0], src[:, :, 4])
    assert (dst[:, :, 1:5] == -1).all()
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(dst[:, :1], None, src[:, :1], None)
    with pytest.raises(ValueError, match="3 blocks into 2"):
        copy_blocks(dst, torch.tensor([1, 2]), src, torch.tensor([1, 2, 3]))


def test_triton_kernel_under_the_interpreter_equals_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "16 cases equal" in r.stdout, r.stdout


@pytest.mark.gpu
def test_triton_kernel_on_cuda_equals_reference():
    assert check_kernel_equals_reference("cuda") == 16


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1 set by the test above)
    print(f"{check_kernel_equals_reference('cpu')} cases equal")
