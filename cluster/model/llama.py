"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each (the loader concatenates the
checkpoint's weights), which halves the launches of a decode step's linear layers.
The forward pass takes flat token ids and positions ([num_tokens]) plus an AttentionMetadata, and
is free of host synchronisation so the decode worker can capture it in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.attention import AttentionBackend, AttentionMetadata, get_backend
from cluster.model.config import ModelArchConfig
from cluster.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, backend: AttentionBackend, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.backend = backend
        self.rope = rope

    def forward(self, x, positions, meta: AttentionMetadata, kv_layer: torch.Tensor):
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rope(positions, q, k)
        out = self.backend.forward(q, k.contiguous(), v.contiguous(), kv_layer, meta)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx, backend, rope):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, backend, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, meta, kv_layer):
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, attention_backend: str = "torch"):
        super().__init__()
        self.cfg = cfg
        backend = get_backend(attention_backend)(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        self.attention_backend = backend
        rope = RotaryEmbedding(cfg)
        self.rotary = rope
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], allocated once."""
        assert kv_cache.shape[0] == self.cfg.num_layers
        self.kv_cache = kv_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden]; logits are computed only where needed."""
        assert self.kv_cache is not None, "bind_kv_cache() first"
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, meta, self.kv_cache[i])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
