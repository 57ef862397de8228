"""SiLU(gate) * up over the fused gate/up projection's output, in one Triton kernel.

Must equal `cluster.kernels.reference.silu_and_mul`: SiLU in float32, rounded to the activation
dtype, then the product rounded again (what torch does with two ops, here without the [T, I]
intermediate or the chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_g, stride_o, n, BLOCK: tl.constexpr):
    DTYPE: tl.constexpr = Out.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(GateUp + t * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GateUp + t * stride_g + n + cols, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    tl.store(Out + t * stride_o + cols, (s * u).to(DTYPE), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_n = gate_up.shape
    n = two_n // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                     BLOCK=BLOCK, num_warps=4)
    return out
