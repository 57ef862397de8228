"""A decode step's model inputs from the one packed buffer the host copies per step, in one Triton kernel.

Must equal `cluster.kernels.reference.decode_inputs`. The host sends per-row scalars and the block
tables packed back to back (`DecodeStepLayout`: one host-to-device copy whatever the batch); inside
the CUDA graph this kernel, one program per row,
- takes the input token from the previous step's output on the device when the row continues from it
  (prev_row >= 0), so the host never waits for a token to launch the next step;
- copies the row's block table (packed with the step's width, read from the buffer) into the
  persistent [rows, max_blocks] table that attention reads;
- derives the slot of the new K/V, the context length, and the position of the token to sample.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.step_layout import DecodeStepLayout


@triton.jit(do_not_specialize=["off_ids", "off_prev", "off_pos", "off_width", "off_tables"])  # vary per bucket
def _decode_inputs_kernel(
    Packed, OutTokens, Ids, Pos, Slots, Ctx, NextPos, Tables,
    off_ids, off_prev, off_pos, off_width, off_tables, stride_tables, block_size,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    prev = tl.load(Packed + off_prev + r)
    host_id = tl.load(Packed + off_ids + r)
    prev_token = tl.load(OutTokens + tl.maximum(prev, 0))
    token = tl.where(prev >= 0, prev_token, host_id.to(tl.int64))
    pos = tl.load(Packed + off_pos + r)
    width = tl.load(Packed + off_width)
    src = Packed + off_tables + r * width
    dst = Tables + r.to(tl.int64) * stride_tables
    c = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        cols = start + c
        tl.store(dst + cols, tl.load(src + cols, mask=cols < width), mask=cols < width)
    blk = tl.load(src + pos // block_size).to(tl.int64)
    tl.store(Ids + r, token)
    tl.store(Pos + r, pos.to(tl.int64))
    tl.store(Slots + r, blk * block_size + pos % block_size)
    tl.store(Ctx + r, pos + 1)
    tl.store(NextPos + r, pos.to(tl.int64) + 1)


def decode_inputs(
    packed: torch.Tensor,  # int32, laid out by DecodeStepLayout(rows)
    rows: int,
    out_tokens: torch.Tensor,  # [>= rows] int64: the previous step's sampled tokens
    ids: torch.Tensor,  # [>= rows] int64 outputs ...
    positions: torch.Tensor,  # int64
    slots: torch.Tensor,  # int64
    context_lens: torch.Tensor,  # int32
    next_positions: torch.Tensor,  # int64: position of the token this step samples
    tables: torch.Tensor,  # [>= rows, max_blocks] int32, row-contiguous
    block_size: int,
) -> None:
    lay = DecodeStepLayout(rows)
    assert packed.dtype == torch.int32 and tables.stride(1) == 1
    _decode_inputs_kernel[(rows,)](
        packed, out_tokens, ids, positions, slots, context_lens, next_positions, tables,
        lay.host_ids, lay.prev_row, lay.positions, lay.width, lay.tables, tables.stride(0), block_size,
        BLOCK=256, num_warps=1,
    )
