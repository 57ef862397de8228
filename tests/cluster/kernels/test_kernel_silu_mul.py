"""SiLU-and-mul kernel against its torch reference."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import reference  # noqa: E402
from cluster.kernels.silu_mul import silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(tokens, inter, dtype, device, ulps):
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = (2 * torch.randn(tokens, 2 * inter, generator=g)).to(device=device, dtype=dtype)
    want = reference.silu_and_mul(gate_up)
    got = silu_and_mul(gate_up)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=ulps * 2**-7, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 1500), (3, 224)])
def test_matches_reference(tokens, inter, dtype):
    # The interpreter truncates to bf16 where the GPU rounds: up to two steps off.
    _check(tokens, inter, dtype, DEVICE, ulps=2 if DEVICE == "cuda" else 3)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("inter", [8192, 14336, 18944])
def test_matches_reference_on_gpu(tokens, inter):
    _check(tokens, inter, torch.bfloat16, "cuda", ulps=2)  # exp vs expf: one step, doubled by the product
