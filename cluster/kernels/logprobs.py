"""Log-probabilities of sampled tokens and the top ones, from the raw logits, without a [B, V] temporary.

Must equal `cluster.kernels.reference.token_logprobs` within float32 rounding (its log-sum-exp is a
tree sum here, a library reduction there).

1. `_lse_partial_kernel`, one program per (row, chunk): the chunk's max and sum of exp(x - max).
2. the k largest logits per row: `torch.topk` (sync-free, capturable; ties in any order).
3. `_finish_kernel`, one program per row: log-sum-exp from the partials, then
   logprob = logit - lse for the row's token and for its k top logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192
BLOCK = 2048


@triton.jit
def _lse_partial_kernel(Logits, stride_l, Part, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    src = Logits + row.to(tl.int64) * stride_l
    lanes = tl.arange(0, BLOCK)
    m = float("-inf")
    z = 0.0
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + lanes
        x = tl.load(src + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), 0)
        m = m_new
    out = (row * tl.num_programs(1) + chunk) * 2
    tl.store(Part + out, m)
    tl.store(Part + out + 1, z)


@triton.jit
def _finish_kernel(Logits, stride_l, Part, num_chunks, Tokens, TopVals, stride_t, OutLp, OutTop, K,
                   CP: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CP)
    ok = c < num_chunks
    m_c = tl.load(Part + (row * num_chunks + c) * 2, mask=ok, other=float("-inf"))
    z_c = tl.load(Part + (row * num_chunks + c) * 2 + 1, mask=ok, other=0.0)
    m = tl.max(m_c, 0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(tl.where(m_c == float("-inf"), 0.0, z_c * tl.exp(m_c - safe)), 0)
    lse = safe + tl.log(z)
    tok = tl.load(Tokens + row)
    tl.store(OutLp + row, tl.load(Logits + row.to(tl.int64) * stride_l + tok).to(tl.float32) - lse)
    k = tl.arange(0, KP)
    vals = tl.load(TopVals + row * stride_t + k, mask=k < K, other=0.0).to(tl.float32)
    tl.store(OutTop + row * K + k, vals - lse, mask=k < K)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int, out_lp: torch.Tensor | None = None,
                   out_top_ids: torch.Tensor | None = None, out_top_lp: torch.Tensor | None = None):
    """Same result as the reference: ([B] float32, [B, k] int64, [B, k] float32), into the out_*
    tensors when given (their first B rows)."""
    b, vocab = logits.shape
    assert logits.stride(1) == 1
    dev = logits.device
    out_lp = torch.empty(b, dtype=torch.float32, device=dev) if out_lp is None else out_lp[:b]
    top_lp = torch.empty(b, k, dtype=torch.float32, device=dev) if out_top_lp is None else out_top_lp[:b]
    if k:
        vals, ids = torch.topk(logits, k, dim=-1)
    else:
        vals, ids = logits[:, :0], torch.empty(b, 0, dtype=torch.int64, device=dev)
    if out_top_ids is not None:
        out_top_ids[:b].copy_(ids)
        ids = out_top_ids[:b]
    if b == 0:
        return out_lp, ids, top_lp
    chunks = triton.cdiv(vocab, CHUNK)
    part = torch.empty(b, chunks, 2, dtype=torch.float32, device=dev)
    _lse_partial_kernel[(b, chunks)](logits, logits.stride(0), part, vocab, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
    assert top_lp.is_contiguous()
    _finish_kernel[(b,)](logits, logits.stride(0), part, chunks, tokens, vals, vals.stride(0) if k else 0, out_lp,
                         top_lp, k, CP=max(2, triton.next_power_of_2(chunks)), KP=max(2, triton.next_power_of_2(max(k, 1))),
                         num_warps=1)
    return out_lp, ids, top_lp
