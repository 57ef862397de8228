"""RMSNorm, alone or fused with the residual add before it, in one Triton kernel.

Must equal `cluster.kernels.reference.rms_norm` / `fused_add_rms_norm`. It rounds where they round
(the sum x + residual and the normalised value to the activation dtype, then the product with the
weight), so in bfloat16 it matches them to within one rounding step (the sum of squares is added in
another order, and 1/sqrt may differ from torch's rsqrt in the last bit).

The fused form works in place, as nano-vllm's and mini-sglang's do: `residual` receives x + residual
(the stream carried from layer to layer) and `x` the normalised output, so a decoder layer's two
norms and two residual adds are two kernels and allocate nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, Out, stride_x, stride_r, stride_o, n, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # the add, rounded like torch's
        tl.store(R + row * stride_r + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x32 * x32, 0) / n + eps)
    y = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * y).to(Out.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float):
    n = x.shape[-1]
    r = residual if residual is not None else x
    assert x.dim() == r.dim() == out.dim() == 2 and x.stride(1) == r.stride(1) == out.stride(1) == 1
    assert weight.is_contiguous() and weight.dtype == x.dtype
    if x.shape[0] == 0:
        return
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](
        x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, n] -> a new [T, n] tensor."""
    out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """In place: residual <- x + residual, x <- rms_norm(residual). Returns (x, residual)."""
    _launch(x, residual, weight, x, eps)
    return x, residual
