"""Fused KV block copy: dst[:, :, dst_ids[b]] = src[:, :, src_ids[b]] for every block b, in one launch.

Both tensors are [layers, 2, blocks, block_size, kv_heads, head_dim]-shaped and contiguous: a KV cache
sliced to a layer range (`cache[l0:l1]`), or a staging buffer of n blocks. Seen as
[planes = layers * 2, blocks, block_numel] the copy is one grid over (block, plane, tile) that moves
raw 8-byte words (never floats: NaN payloads stay bit-exact), gathering, scattering or both at once.
ids=None means blocks 0..n-1 (a staging buffer). This one kernel is the same-GPU transfer (prefill
cache -> decode pool through CUDA IPC) and the gather/scatter around an NCCL message.

Reference: `copy_blocks_reference` (torch index_select + index_copy_), which the kernel must equal bit
for bit; tests run the kernel under the Triton interpreter (TRITON_INTERPRET=1) against it on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE_BYTES = 8192  # per program: a 32 KiB block (8B shape) is 4 programs of 1024 words


def copy_blocks_reference(dst: torch.Tensor, dst_ids: torch.Tensor | None, src: torch.Tensor,
                          src_ids: torch.Tensor | None) -> None:
    g = src if src_ids is None else src.index_select(2, src_ids.to(src.device, torch.long))
    if dst_ids is None:
        dst.copy_(g)
    else:
        dst.index_copy_(2, dst_ids.to(dst.device, torch.long), g.to(dst.device))


def _words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as the widest integer words that tile a block row (int64 for every real model)."""
    row = t.shape[-1] * t.element_size()
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % size == 0 and t.element_size() <= size:
            return t.view(dt)
    return t.view(torch.uint8)


def _check(dst: torch.Tensor, dst_ids, src: torch.Tensor, src_ids) -> int:
    if dst.dtype != src.dtype or dst.shape[:2] != src.shape[:2] or dst.shape[3:] != src.shape[3:]:
        raise ValueError(f"block copy between unlike tensors: {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("block copy needs contiguous tensors (a cache sliced on its layer dimension is)")
    n = src.shape[2] if src_ids is None else src_ids.numel()
    if (dst.shape[2] if dst_ids is None else dst_ids.numel()) != n:
        raise ValueError(f"block copy of {n} blocks into {dst.shape[2] if dst_ids is None else dst_ids.numel()}")
    return n


def copy_blocks(dst: torch.Tensor, dst_ids: torch.Tensor | None, src: torch.Tensor, src_ids: torch.Tensor | None,
                use_triton: bool | None = None) -> None:
    """Enqueues the copy on the current stream (ids: int32/int64 tensors on the tensors' device).
    use_triton=None: the kernel on CUDA, the torch reference on CPU; True forces the kernel (tests run
    it on CPU under the Triton interpreter)."""
    n = _check(dst, dst_ids, src, src_ids)
    if use_triton is None:
        use_triton = dst.is_cuda
    if n == 0:
        return
    if not use_triton:
        copy_blocks_reference(dst, dst_ids, src, src_ids)
        return
    dst, src = _words(dst), _words(src)
    block_words = dst[0, 0, 0].numel()
    tile = min(triton.next_power_of_2(block_words), max(1, _TILE_BYTES // dst.element_size()))
    grid = (n, dst.shape[0] * 2, triton.cdiv(block_words, tile))
    # NOTE: plane p = 2 * layer + kv sits at p * stride(1): true of contiguous [layers, 2, blocks, ...].
    _copy_blocks_kernel[grid](
        dst, dst if dst_ids is None else dst_ids, src, src if src_ids is None else src_ids,
        dst.stride(1), dst.stride(2), src.stride(1), src.stride(2),
        BLOCK_WORDS=block_words, TILE=tile, DST_DENSE=dst_ids is None, SRC_DENSE=src_ids is None, num_warps=4)


@triton.jit
def _copy_blocks_kernel(dst_ptr, dst_ids_ptr, src_ptr, src_ids_ptr,
                        dst_plane_stride, dst_block_stride, src_plane_stride, src_block_stride,
                        BLOCK_WORDS: tl.constexpr, TILE: tl.constexpr,
                        DST_DENSE: tl.constexpr, SRC_DENSE: tl.constexpr):
    b = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    if SRC_DENSE:
        s = b.to(tl.int64)
    else:
        s = tl.load(src_ids_ptr + b).to(tl.int64)
    if DST_DENSE:
        d = b.to(tl.int64)
    else:
        d = tl.load(dst_ids_ptr + b).to(tl.int64)
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < BLOCK_WORDS
    x = tl.load(src_ptr + plane * src_plane_stride + s * src_block_stride + offs, mask=mask)
    tl.store(dst_ptr + plane * dst_plane_stride + d * dst_block_stride + offs, x, mask=mask)
