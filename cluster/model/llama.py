"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each (the loader concatenates the
checkpoint's weights). The decoder's linears are `cluster.model.linear.Linear`s whose method comes
from the model's QuantConfig (unquantized, or FP8 weights); the LM head and embedding stay in the
model's dtype. With an FP8 KV cache, each attention layer's k/v scales (1.0 unless the checkpoint
carries them) quantize K/V on write and dequantize on read. A decoder layer is a handful of kernels, as in nano-vllm and mini-sglang:
    add+RMSNorm -> QKV matmul -> rotary + KV write -> attention -> O matmul
    -> add+RMSNorm -> gate/up matmul -> SiLU*mul -> down matmul
with the residual stream carried between layers beside the hidden state (each norm adds it in). On
CUDA the non-matmul steps are the Triton kernels of `cluster.kernels`; elsewhere their torch
references, which are the model's original float32 arithmetic (greedy output equals transformers').

Tensor parallelism (`tp`, a cluster.model.parallel_linear.TensorParallel; None: one process holds the
whole model, exactly as before): the fused QKV and gate/up are column-parallel, o_proj and down_proj
row-parallel with one all-reduce each, the LM head vocabulary-parallel, the embedding and norms
replicated (parallel_linear.py says why); each rank's attention runs its own q heads over its own KV
heads (cluster/distributed/sharding.py), so its KV cache holds only those.

The forward pass takes flat token ids and positions ([num_tokens]) plus an AttentionMetadata, and is
free of host synchronisation so the decode worker can capture it in a CUDA graph. Each layer writes
its K/V into the paged cache inside its own forward (per-layer hooks see that layer's KV complete).
"""

from __future__ import annotations

import torch
from torch import nn

from cluster import kernels
from cluster.attention import AttentionBackend, AttentionMetadata, get_backend
from cluster.errors import ModelLoadError
from cluster.model.config import ModelArchConfig
from cluster.model.linear import Fp8LinearMethod, Linear, LinearMethod, UnquantizedLinearMethod
from cluster.model.parallel_linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TensorParallel
from cluster.model.quantization import QuantConfig
from cluster.model.rope import RotaryEmbedding


def linear_method(quant: QuantConfig, checkpoint_modules: list[str]) -> LinearMethod:
    """The method of a layer fusing these checkpoint modules (Hugging Face names)."""
    scheme = quant.scheme_for(checkpoint_modules)
    return UnquantizedLinearMethod() if scheme is None else Fp8LinearMethod(scheme)


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """Nothing: the model is built on the meta device and the loader fills every weight.
        (A random init on meta runs torch._refs, whose first call imports torch._dynamo: see
        RotaryEmbedding.build_tables.)"""


class _LMHead(nn.Linear):
    def reset_parameters(self) -> None:
        """Nothing, as `_Embedding`'s."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); or, given the residual stream, (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, backend: AttentionBackend, rope: RotaryEmbedding,
                 dtype: torch.dtype, quant: QuantConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        p = f"model.layers.{layer_idx}.self_attn."
        qkv_method = linear_method(quant, [p + "q_proj", p + "k_proj", p + "v_proj"])
        o_method = linear_method(quant, [p + "o_proj"])
        if tp is None:
            self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
            self.qkv_proj = Linear(cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.attention_bias,
                                   qkv_method, dtype, ("q", "k", "v"))
            self.o_proj = Linear(cfg.q_size, (cfg.hidden_size,), False, o_method, dtype)
        else:
            sh = tp.shard
            self.num_heads, self.num_kv_heads = sh.num_heads, sh.num_kv_heads
            (q0, qn), (k0, kn) = sh.q_rows, sh.kv_rows
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, ((cfg.q_size, q0, qn), (cfg.kv_size, k0, kn),
                                                                   (cfg.kv_size, k0, kn)),
                                                 cfg.attention_bias, qkv_method, dtype, ("q", "k", "v"))
            self.o_proj = RowParallelLinear((cfg.q_size, q0, qn), cfg.hidden_size, False, o_method, dtype, tp.comm,
                                            sh.rank)
        self.q_size = self.num_heads * cfg.head_dim
        self.backend = backend
        self.rope = rope
        # An FP8 KV cache stores k / k_scale and v / v_scale (host floats, fixed at load: kernel
        # arguments, so a captured graph keeps them). Unused with a cache in the model's dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, positions, x, meta: AttentionMetadata, kv_layer: torch.Tensor):
        cfg = self.cfg
        q, k, v = kernels.rotary_store_kv(self.qkv_proj(x), positions, self.rope.cos_sin, kv_layer, meta.slot_mapping,
                                          self.num_heads, self.num_kv_heads, cfg.head_dim, self.k_scale, self.v_scale)
        out = self.backend.forward(q, k, v, kv_layer, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype: torch.dtype, quant: QuantConfig,
                 tp: TensorParallel | None = None):
        super().__init__()
        p = f"model.layers.{layer_idx}.mlp."
        gate_up = linear_method(quant, [p + "gate_proj", p + "up_proj"])
        down = linear_method(quant, [p + "down_proj"])
        inter = cfg.intermediate_size
        if tp is None:
            self.gate_up_proj = Linear(cfg.hidden_size, (inter,) * 2, cfg.mlp_bias, gate_up, dtype, (0, 1))
            self.down_proj = Linear(inter, (cfg.hidden_size,), cfg.mlp_bias, down, dtype)
        else:
            i0, n = tp.shard.mlp_rows
            self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, ((inter, i0, n),) * 2, cfg.mlp_bias, gate_up,
                                                     dtype, (0, 1))
            self.down_proj = RowParallelLinear((inter, i0, n), cfg.hidden_size, cfg.mlp_bias, down, dtype, tp.comm,
                                               tp.rank)

    def forward(self, x):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx, backend, rope, dtype, quant, tp=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, backend, rope, dtype, quant, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, layer_idx, dtype, quant, tp)

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
    def __init__(self, cfg: ModelArchConfig, attention_backend: str = "torch", dtype: torch.dtype = torch.float32,
                 quant: QuantConfig | None = None, tp: TensorParallel | None = None):
        super().__init__()
        quant = quant or QuantConfig()
        if quant.scheme_for(["lm_head"]) is not None:
            raise ModelLoadError(f"a quantized lm_head is not supported ({quant.method}); list it in `ignore`")
        self.cfg = cfg
        self.quant = quant
        self.tp = tp
        heads, kv_heads = (cfg.num_heads, cfg.num_kv_heads) if tp is None else (tp.shard.num_heads, tp.shard.num_kv_heads)
        self.num_kv_heads = kv_heads  # this rank's: the KV cache's heads dimension
        backend = get_backend(attention_backend)(heads, kv_heads, cfg.head_dim, cfg.sliding_window)
        self.attention_backend = backend
        rope = RotaryEmbedding(cfg)
        self.rotary = rope
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, rope, dtype, quant, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if tp is None:
            self.lm_head = _LMHead(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        else:
            self.lm_head = ParallelLMHead(cfg.hidden_size, tp, dtype)
        self.tie_weights()
        self.kv_cache: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Tied embeddings: the LM head reads the embedding's rows (again after `to_empty` or a load)."""
        if not self.cfg.tie_word_embeddings:
            return
        if self.tp is None:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.tie(self.embed_tokens.weight)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], allocated once (this
        rank's KV heads under tensor parallelism)."""
        assert kv_cache.shape[0] == self.cfg.num_layers and kv_cache.shape[4] == self.num_kv_heads
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
        """Logits in the model's dtype (the sampler reads any float dtype; no float32 copy of [B, V]); all
        of the vocabulary on every rank under tensor parallelism (a collective: every rank calls it)."""
        return self.lm_head(hidden)
