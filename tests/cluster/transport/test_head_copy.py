"""The fused head-range block copy (tensor-parallel KV links that move part of a rank's heads): its
Triton kernel equals the torch reference bit for bit (on CPU under the Triton interpreter, in a child
process because TRITON_INTERPRET must be set before triton loads; on CUDA directly), and the reference
moves exactly the named heads of the named blocks."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.transport.head_copy import copy_block_heads, copy_block_heads_reference


def _cases(device):
    """(dst, dst_ids, dst_h0, src, src_ids, src_h0, n): gather a head range into staging, scatter it into
    another cache's heads, cache to cache with different head counts, dtypes, NaN bits, odd sizes."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    out = []
    for dtype, L, nb, bs, h_src, h_dst, hd, h0s, h0d, n in [
            (torch.bfloat16, 3, 12, 4, 4, 8, 8, 2, 4, 2), (torch.float32, 2, 9, 16, 2, 1, 4, 1, 0, 1),
            (torch.float16, 2, 7, 16, 8, 4, 16, 4, 0, 4), (torch.float32, 2, 6, 3, 3, 3, 3, 0, 1, 2)]:
        src = torch.randn((L, 2, nb, bs, h_src, hd), generator=g).to(dtype).to(device)
        src.view(torch.uint8)[0, 0, 1].fill_(0xFF)  # a NaN payload must travel unchanged
        ids = lambda k: torch.tensor(rng.sample(range(1, nb), k), dtype=torch.int32, device=device)  # noqa: E731
        k = 4
        staging = torch.zeros((L, 2, k, bs, n, hd), dtype=dtype, device=device)
        out.append((staging, None, 0, src, ids(k), h0s, n))  # gather: the sender's side of a link
        dst = torch.zeros((L, 2, nb, bs, h_dst, hd), dtype=dtype, device=device)
        full = staging.clone().normal_(generator=g if device == "cpu" else None)
        out.append((dst.clone(), ids(k), h0d, full, None, 0, n))  # scatter into the receiver's heads
        out.append((dst.clone(), ids(k), h0d, src, ids(k), h0s, n))  # cache to cache
        out.append((dst[1:].clone(), ids(k), h0d, src[1:].contiguous(), ids(k), h0s, n))  # a layer range
    return out


def check_kernel_equals_reference(device: str) -> int:
    count = 0
    for dst, dst_ids, dh0, src, src_ids, sh0, n in _cases(device):
        want = dst.clone()
        copy_block_heads_reference(want, dst_ids, dh0, src, src_ids, sh0, n)
        copy_block_heads(dst, dst_ids, dh0, src, src_ids, sh0, n, use_triton=True)
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), (dst.dtype, dst.shape)
        count += 1
    return count


def test_reference_moves_exactly_the_named_heads():
    src = torch.arange(2 * 2 * 6 * 3 * 4, dtype=torch.float32).view(2, 2, 6, 3, 4, 1)
    dst = torch.full((2, 2, 6, 3, 2, 1), -1.0)
    copy_block_heads(dst, torch.tensor([5, 0]), 1, src, torch.tensor([1, 4]), 2, 1)
    assert torch.equal(dst[:, :, 5, :, 1], src[:, :, 1, :, 2]) and torch.equal(dst[:, :, 0, :, 1], src[:, :, 4, :, 2])
    assert (dst[:, :, :, :, 0] == -1).all() and (dst[:, :, 1:5] == -1).all()
    with pytest.raises(ValueError, match="out of"):
        copy_block_heads(dst, None, 1, src[:, :, :6], None, 3, 2)
    with pytest.raises(ValueError, match="contiguous"):
        copy_block_heads(dst[:, :1], None, 0, src[:, :1], None, 0, 1)


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
