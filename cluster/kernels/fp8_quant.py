"""Per-token FP8 quantization of activations for the W8A8 path, in one Triton kernel (one program per row).

Must equal `cluster.kernels.reference.quantize_per_token`: scale = max(amax(|row|) / 448,
FP8_MIN_SCALE) in float32 (or the checkpoint's static per-tensor scale for every row), then
e4m3(clamp(x / scale, -448, 448)) rounded to nearest even; returns the e4m3 rows and the [M, 1]
float32 scales torch._scaled_mm takes as its row-wise scale_a. In torch this is four or five kernels
(abs, amax, divide, clamp, cast) per linear; in a 256-row decode step that is ~600 launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.reference import FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _quant_kernel(X, Q, Scale, StaticScale, K, stride_x, stride_q, FMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                  STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(StaticScale)
    else:
        # NOTE: div_rn both times: Triton's "/" on float32 lowers to div.approx (2 ulp), torch divides exactly.
        amax = tl.max(tl.abs(x), 0)
        s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.broadcast_to(s, x.shape)), -FMAX), FMAX)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=ok)
    tl.store(Scale + row, s)


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """[M, K] -> (float8_e4m3fn [M, K], float32 [M, 1])."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_kernel[(m,)](x, q, scale, static_scale if static_scale is not None else scale, k, x.stride(0), q.stride(0),
                            FMAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, STATIC=static_scale is not None, BLOCK=block,
                            num_warps=max(1, min(16, block // 1024)))
    return q, scale
