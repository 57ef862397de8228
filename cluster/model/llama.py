"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each (the loader concatenates the
checkpoint's weights). A decoder layer is a handful of kernels, as in nano-vllm and mini-sglang:
    add+RMSNorm -> QKV matmul -> rotary + KV write -> attention -> O matmul
    -> add+RMSNorm -> gate/up matmul -> SiLU*mul -> down matmul
with the residual stream carried between layers beside the hidden state (each norm adds it in). On
CUDA the non-matmul steps are the Triton kernels of `cluster.kernels`; elsewhere their torch
references, which are the model's original float32 arithmetic (greedy output equals transformers').

The forward pass takes flat token ids and positions ([num_tokens]) plus an AttentionMetadata, and is
free of host synchronisation so the decode worker can capture it in a CUDA graph. Each layer writes
its K/V into the paged cache inside its own forward (per-layer hooks see that layer's KV complete).
"""

from __future__ import annotations

import torch
from torch import nn

from cluster import kernels
from cluster.attention import AttentionBackend, AttentionMetadata, get_backend
from cluster.model.config import ModelArchConfig
from cluster.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); or, given the residual stream, (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, backend: AttentionBackend, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.backend = backend
        self.rope = rope

    def forward(self, positions, x, meta: AttentionMetadata, kv_layer: torch.Tensor):
        cfg = self.cfg
        q, k, v = kernels.rotary_store_kv(self.qkv_proj(x), positions, self.rope.cos_sin, kv_layer, meta.slot_mapping,
                                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        out = self.backend.forward(q, k, v, kv_layer, meta)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx, backend, rope):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, backend, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, hidden, residual, meta, kv_layer):
        """(hidden, residual) -> (hidden, residual); the layer's input is their sum (residual None:
        hidden alone, for the first layer). Writes this layer's K/V for the new tokens."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_layer)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


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
        meta = self.attention_backend.plan(meta)  # once per pass, shared by every layer
        hidden, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta, self.kv_cache[i])
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler reads any float dtype; no float32 copy of [B, V])."""
        return self.lm_head(hidden)
