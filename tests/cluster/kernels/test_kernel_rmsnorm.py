"""RMSNorm kernels against their torch reference: on CPU through Triton's interpreter, on GPU natively."""

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported

from cluster.kernels import reference  # noqa: E402
from cluster.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, n, generator=g)).to(device=device, dtype=dtype)
    r = torch.randn(rows, n, generator=g).to(device=device, dtype=dtype)
    w = (1 + 0.2 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)
    return x, r, w


def _check(rows, n, dtype, device, seed, ulps):
    x, r, w = _inputs(rows, n, dtype, device, seed)
    want = reference.rms_norm(x, w, 1e-5)
    got = rms_norm(x, w, 1e-5)
    want_y, want_r = reference.fused_add_rms_norm(x, r, w, 1e-5)
    y, res = x.clone(), r.clone()
    out = fused_add_rms_norm(y, res, w, 1e-5)
    assert out[0] is y and out[1] is res  # in place
    # In bf16: `ulps` rounding steps of the output (Triton's interpreter truncates where the GPU rounds).
    tol = dict(rtol=ulps * 2**-7, atol=1e-6) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(res, want_r, **tol)
    torch.testing.assert_close(y, want_y, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (3, 200)])
def test_matches_reference(rows, n, dtype):
    _check(rows, n, dtype, DEVICE, seed=rows * n, ulps=2 if DEVICE == "cuda" else 3)


def test_leaves_other_rows_alone_and_handles_no_rows():
    x, r, w = _inputs(5, 64, torch.float32, DEVICE, 0)
    assert rms_norm(x[:0], w, 1e-5).shape == (0, 64)
    big = torch.full((8, 64), float("nan"), device=DEVICE)
    big[:5] = x
    res = torch.full((8, 64), float("nan"), device=DEVICE)
    res[:5] = r
    fused_add_rms_norm(big[:5], res[:5], w, 1e-5)
    assert torch.isnan(big[5:]).all() and torch.isnan(res[5:]).all() and torch.isfinite(big[:5]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 4099])
@pytest.mark.parametrize("n", [2048, 4096, 3584])
def test_matches_reference_on_gpu(rows, n):
    _check(rows, n, torch.bfloat16, "cuda", seed=rows + n, ulps=2)  # rsqrt vs 1/sqrt: one step, doubled by the product
