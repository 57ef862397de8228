"""The torch references of the forward pass's fused kernels: what runs on CPU, and what each Triton
kernel in this package must equal (its tests compare the two on random inputs).

They round where the unfused PyTorch model (and Hugging Face's) rounds, so in float32 they are the
model's original arithmetic, op for op: greedy decoding on CPU stays token-exact with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.kernels.step_layout import DecodeStepLayout

# -- RMSNorm ------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x): statistics in float32, the normalised value cast back to x's dtype first."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual <- x + residual; returns (rms_norm(residual), residual). The add is in x's dtype."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


# -- rotary embedding + paged KV write ---------------------------------------------------------


def rotary_store_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KH) * D]: the fused projection's output
    positions: torch.Tensor,  # [T]
    cos_sin: torch.Tensor,  # [max_positions, D]: cos of the D/2 frequencies, then their sin
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KH, D]
    slot_mapping: torch.Tensor,  # [T]: block * block_size + offset of each token's K/V
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotates q and k (Hugging Face's rotate_half convention) and writes k, v into their slots.
    Returns q, k, v as [T, heads, D]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    cs = cos_sin[positions]
    cos, sin = cs.chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    kv_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# -- SiLU and mul -------------------------------------------------------------------------------


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- sampling -----------------------------------------------------------------------------------
# Counter-based noise: a 32-bit hash of (seed, position, token id), so a seeded request draws the
# same noise in any batch, on any worker, and a CUDA graph can replay sampling. The kernel in
# cluster/kernels/sampling.py computes the same hash in uint32; here uint32 arithmetic is emulated
# in int64 (products split in 16-bit halves so that nothing overflows).

_M32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
POSITION_MUL = 0x85EBCA6B
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit keys of (seed, position); seeds in [0, 2**63)."""
    seeds = seeds.long()
    k = mix32((seeds >> 32) ^ GOLDEN32)
    k = mix32(k ^ (seeds & _M32))
    return mix32((k + _mul32(positions.long() & _M32, POSITION_MUL)) & _M32)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1): 24 bits of mix32(key + token * golden), plus half a step."""
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = mix32((row_keys(seeds, positions)[:, None] + _mul32(cols, GOLDEN32)[None, :]) & _M32)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def kept_tokens(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the top-k / top-p set of each row of temperature-scaled logits.

    Tokens are ranked by (logit descending, token id ascending). A token is kept iff fewer than top_k
    tokens rank before it (top_k <= 0: no limit) and the probability mass ranked before it is below
    top_p (the smallest prefix reaching top_p; the first token is always kept)."""
    vocab = scaled.shape[-1]
    s, order = scaled.sort(dim=-1, descending=True, stable=True)
    e = torch.exp(s - s[:, :1])
    before = e.cumsum(dim=-1) - e
    total = e.sum(dim=-1, keepdim=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    keep = ((top_k <= 0)[:, None] | (ranks < top_k[:, None])) & ((top_p >= 1)[:, None] | (before < top_p[:, None] * total))
    return torch.empty_like(keep).scatter_(-1, order, keep)


def sample(
    logits: torch.Tensor,  # [B, V], any float dtype
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_k: torch.Tensor,  # [B] int, <= 0 = off
    top_p: torch.Tensor,  # [B] float32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B]: position of the token being sampled
    filtered: bool | None = None,  # some row uses top-k/top-p; None: find out (a host sync on CUDA)
) -> torch.Tensor:  # [B] int64
    """Greedy rows take the argmax. Sampled rows take argmax(logits / T + Gumbel) over their kept set:
    the Gumbel-max trick (an exponential race), which draws exactly from softmax(logits / T) restricted
    to the kept set, with noise -log(-log(u)) from uniform_noise."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = x / temp[:, None]
    score = scaled - torch.log(-torch.log(uniform_noise(seeds, positions, x.shape[-1])))
    if filtered is None:
        filtered = bool((top_k > 0).any() or (top_p < 1).any())
    if filtered:
        score = score.masked_fill(~kept_tokens(scaled, top_k, top_p), float("-inf"))
    return torch.where(temperature == 0, greedy, score.argmax(dim=-1))


# -- a decode step's inputs from the packed per-step buffer -------------------------------------


def decode_inputs(packed, rows, out_tokens, ids, positions, slots, context_lens, next_positions, tables,
                  block_size) -> None:
    """Fills the step's input buffers from `packed` (laid out by DecodeStepLayout(rows)); see
    cluster/kernels/decode_step_inputs.py. Reads the width on the host: CPU only."""
    lay = DecodeStepLayout(rows)
    width = int(packed[lay.width])
    prev = packed[lay.prev_row : lay.prev_row + rows].long()
    pos = packed[lay.positions : lay.positions + rows].long()
    table = packed[lay.tables : lay.tables + rows * width].view(rows, width)
    tables[:rows, :width] = table
    ids[:rows] = torch.where(prev >= 0, out_tokens[prev.clamp(min=0)], packed[lay.host_ids : lay.host_ids + rows].long())
    blk = table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long()
    positions[:rows] = pos
    slots[:rows] = blk * block_size + pos % block_size
    context_lens[:rows] = (pos + 1).to(context_lens.dtype)
    next_positions[:rows] = pos + 1
