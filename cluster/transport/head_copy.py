"""Fused KV block copy of a head range: dst[:, :, dst_ids[b], :, dh0:dh0+n] = src[:, :, src_ids[b], :, sh0:sh0+n]
for every block b, in one launch: the gather and scatter of a tensor-parallel KV transfer whose link
moves part of a rank's heads (cluster/transport/plan.py: HeadLink).

Both tensors are [layers, 2, blocks, block_size, heads, head_dim]-shaped and contiguous (a KV cache
sliced to a layer range, or a staging buffer holding just the link's heads); they may have different
head counts. A block's rows (one per token) hold every head of it back to back, so a head range is one
run of n * head_dim elements per row: one program copies a tile of rows of one block's plane, as raw
words (never floats: NaN payloads stay bit-exact), the widest that tile the run. ids=None means blocks
0..count-1 (a staging buffer). Where a link moves every head of both caches, block_copy.py's whole-block
copy runs instead.

Reference: `copy_block_heads_reference` (index_select + index_copy_ on the head-narrowed views), which
the kernel must equal bit for bit; tests run the kernel under the Triton interpreter on CPU against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE_WORDS = 8192  # per program: e.g. 16 rows of 4 heads x 128 x bf16 is 2048 int64 words


def copy_block_heads_reference(dst, dst_ids, dst_h0: int, src, src_ids, src_h0: int, n: int) -> None:
    g = src.narrow(4, src_h0, n)
    if src_ids is not None:
        g = g.index_select(2, src_ids.to(src.device, torch.long))
    d = dst.narrow(4, dst_h0, n)
    if dst_ids is None:
        d.copy_(g)
    else:
        d.index_copy_(2, dst_ids.to(dst.device, torch.long), g.to(dst.device))


def _word(t: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.dtype, int]:
    """The widest integer word dividing every byte count in `dims` (and at least the element)."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.element_size() <= size and all(d % size == 0 for d in dims):
            return dt, size
    return torch.uint8, 1


def copy_block_heads(dst: torch.Tensor, dst_ids: torch.Tensor | None, dst_h0: int, src: torch.Tensor,
                     src_ids: torch.Tensor | None, src_h0: int, n: int, use_triton: bool | None = None) -> None:
    """Enqueues the copy on the current stream (ids: int32/int64 tensors on the tensors' device).
    use_triton=None: the kernel on CUDA, the reference on CPU; True forces the kernel (interpreter tests)."""
    if dst.dtype != src.dtype or dst.shape[:2] != src.shape[:2] or dst.shape[3] != src.shape[3] \
            or dst.shape[5] != src.shape[5]:
        raise ValueError(f"head copy between unlike tensors: {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("head copy needs contiguous tensors (a cache sliced on its layer dimension is)")
    if src_h0 < 0 or dst_h0 < 0 or src_h0 + n > src.shape[4] or dst_h0 + n > dst.shape[4] or n <= 0:
        raise ValueError(f"heads [{src_h0}, {src_h0 + n}) -> [{dst_h0}, {dst_h0 + n}) out of {src.shape[4]} / {dst.shape[4]}")
    count = src.shape[2] if src_ids is None else src_ids.numel()
    if (dst.shape[2] if dst_ids is None else dst_ids.numel()) != count:
        raise ValueError(f"head copy of {count} blocks into {dst.shape[2] if dst_ids is None else dst_ids.numel()}")
    if use_triton is None:
        use_triton = dst.is_cuda
    if count == 0:
        return
    if not use_triton:
        copy_block_heads_reference(dst, dst_ids, dst_h0, src, src_ids, src_h0, n)
        return
    head_bytes = src.shape[5] * src.element_size()
    dt, size = _word(src, (head_bytes,))
    hw = head_bytes // size  # words per head
    dst_w, src_w = dst.view(dt), src.view(dt)  # [layers, 2, blocks, bs, heads, hd * elem / size]
    bs = src.shape[3]
    seg = n * hw
    seg_p2 = triton.next_power_of_2(seg)
    rows = max(1, min(triton.next_power_of_2(bs), _TILE_WORDS // seg_p2))
    grid = (count, src.shape[0] * 2, triton.cdiv(bs, rows))
    # NOTE: plane p = 2 * layer + kv sits at p * stride(1): true of contiguous [layers, 2, blocks, ...].
    _copy_heads_kernel[grid](
        dst_w, dst_w if dst_ids is None else dst_ids, src_w, src_w if src_ids is None else src_ids,
        dst_w.stride(1), dst_w.stride(2), dst_w.stride(3), dst_h0 * hw,
        src_w.stride(1), src_w.stride(2), src_w.stride(3), src_h0 * hw,
        bs, SEG=seg, SEG_P2=seg_p2, ROWS=rows, DST_DENSE=dst_ids is None, SRC_DENSE=src_ids is None, num_warps=4)


@triton.jit
def _copy_heads_kernel(dst_ptr, dst_ids_ptr, src_ptr, src_ids_ptr,
                       dst_plane, dst_block, dst_row, dst_off, src_plane, src_block, src_row, src_off,
                       block_size, SEG: tl.constexpr, SEG_P2: tl.constexpr, ROWS: tl.constexpr,
                       DST_DENSE: tl.constexpr, SRC_DENSE: tl.constexpr):
    b = tl.program_id(0)
    p = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS
    if SRC_DENSE:
        sb = b.to(tl.int64)
    else:
        sb = tl.load(src_ids_ptr + b).to(tl.int64)
    if DST_DENSE:
        db = b.to(tl.int64)
    else:
        db = tl.load(dst_ids_ptr + b).to(tl.int64)
    rows = r0 + tl.arange(0, ROWS)
    cols = tl.arange(0, SEG_P2)
    mask = (rows[:, None] < block_size) & (cols[None, :] < SEG)
    s = src_ptr + p.to(tl.int64) * src_plane + sb * src_block + src_off
    d = dst_ptr + p.to(tl.int64) * dst_plane + db * dst_block + dst_off
    x = tl.load(s + rows[:, None].to(tl.int64) * src_row + cols[None, :], mask=mask)
    tl.store(d + rows[:, None].to(tl.int64) * dst_row + cols[None, :], x, mask=mask)
