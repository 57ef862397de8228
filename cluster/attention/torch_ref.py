"""Reference attention in plain PyTorch: runs on CPU and GPU, and is what the fast kernels are checked against.

Prefill loops over the packed sequences on the host (prefill is eager and knows every length).
Decode gathers each sequence's blocks into a dense [B, max_blocks * block_size] view and masks
past `context_lens`: fixed shapes, no host sync, so it can be captured in a CUDA graph as it is.

FP8 KV cache: keys and values are dequantized (`reference.kv_dequantize`: float32 e4m3 * scale) as they
are read, and prefill then reads the new tokens' K/V from the cache too (the quantized values the
decode steps will see, as the Triton prefill kernel does), in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.attention.backend import AttentionBackend
from cluster.attention.metadata import AttentionMetadata
from cluster.kernels.reference import FP8, kv_dequantize
from cluster.kv.kv_blocks import blocks_for_tokens


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_layer, meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0):
        if meta.is_prefill:
            return self._prefill(q, k, v, kv_layer, meta, k_scale, v_scale)
        return self._decode(q, kv_layer, meta, k_scale, v_scale)

    def _prefill(self, q, k, v, kv_layer, meta: AttentionMetadata, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        block_size = kv_layer.shape[2]
        fp8 = kv_layer.dtype == FP8
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            qs = q[start : start + q_len]
            cached = ctx_len - q_len
            if cached == 0 and not fp8:
                ks, vs = k[start : start + q_len], v[start : start + q_len]
            else:  # a later chunk of a long prompt (or an FP8 cache): K/V come from the cache
                nb = blocks_for_tokens(ctx_len, block_size)
                blocks = meta.block_tables[i, :nb].long()
                ks = kv_layer[0][blocks].flatten(0, 1)[:ctx_len]
                vs = kv_layer[1][blocks].flatten(0, 1)[:ctx_len]
                if fp8:
                    qs, ks, vs = qs.float(), kv_dequantize(ks, k_scale), kv_dequantize(vs, v_scale)
            mask = None
            if cached or (self.sliding_window and ctx_len > self.sliding_window):
                qpos = torch.arange(cached, ctx_len, device=q.device)[:, None]
                kpos = torch.arange(ctx_len, device=q.device)[None, :]
                mask = kpos <= qpos
                if self.sliding_window:
                    mask &= kpos > qpos - self.sliding_window
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start : start + q_len] = o.squeeze(0).transpose(0, 1).to(out.dtype)
            start += q_len
        return out

    def _decode(self, q, kv_layer, meta: AttentionMetadata, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        b, max_blocks = meta.block_tables.shape
        block_size = kv_layer.shape[2]
        kvh, hd, g = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        tables = meta.block_tables.long()
        keys = kv_layer[0][tables].view(b, max_blocks * block_size, kvh, hd)
        values = kv_layer[1][tables].view(b, max_blocks * block_size, kvh, hd)
        qg = q.view(b, kvh, g, hd)
        scores = torch.einsum("bkgd,bskd->bkgs", qg.float(), kv_dequantize(keys, k_scale)) * self.scale
        pos = torch.arange(max_blocks * block_size, device=q.device)[None, :]
        ctx = meta.context_lens.long()[:, None]
        invalid = pos >= ctx
        if self.sliding_window:
            invalid |= pos < ctx - self.sliding_window
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bkgs,bskd->bkgd", probs, kv_dequantize(values, v_scale))
        return out.reshape(b, self.num_heads, hd).to(q.dtype)
