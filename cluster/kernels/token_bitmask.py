"""Grammar masks on the logits, in place: a row whose mask index is >= 0 gets -inf at every token its
bitmask row does not allow; a row with index -1 is left alone.

Must equal `cluster.kernels.reference.apply_token_bitmask`. One program per (row, BLOCK tokens): it
reads the row's index first and returns at once when it is -1, so a step's unconstrained rows cost
one 4-byte load per program and nothing else (the kernel sits in every decode graph). A constrained
row reads its bitmask words (one per 32 tokens) and writes -inf only where a token is banned; the
logits are never read. Bitmask layout: cluster.structured.grammar. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(Logits, stride_l, RowMask, Bitmask, stride_b, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index = tl.load(RowMask + row)
    if index >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        words = tl.load(Bitmask + index.to(tl.int64) * stride_b + (offs >> 5), mask=inside, other=0)
        banned = ((words >> (offs & 31)) & 1) == 0
        dst = Logits + row.to(tl.int64) * stride_l + offs
        tl.store(dst, tl.full([BLOCK], float("-inf"), Logits.dtype.element_ty), mask=inside & banned)


def apply_token_bitmask(logits: torch.Tensor, row_mask: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype, row stride free), row_mask [>= B] int32 (index into bitmask or
    -1), bitmask [S, ceil(V / 32)] int32. In place; returns logits."""
    b, vocab = logits.shape
    assert logits.stride(1) == 1 and row_mask.dtype == torch.int32 and bitmask.dtype == torch.int32
    assert bitmask.stride(1) == 1 and bitmask.shape[1] * 32 >= vocab
    if b:
        _apply_token_bitmask_kernel[(b, triton.cdiv(vocab, BLOCK))](
            logits, logits.stride(0), row_mask, bitmask, bitmask.stride(0), vocab, BLOCK=BLOCK, num_warps=4)
    return logits
