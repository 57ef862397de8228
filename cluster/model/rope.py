"""Rotary position embedding, including Llama-3's frequency rescaling.

The cos/sin tables are computed once in float32 for every position the model supports, so a decode
step only gathers rows by position: no per-step trigonometry and no host work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cluster.model.config import ModelArchConfig


def inverse_frequencies(cfg: ModelArchConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = dict(cfg.rope_scaling)
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables(None)  # on the default device (meta inside the loader)

    def build_tables(self, device: torch.device | str | None) -> None:
        """(Re)computes the float32 tables; the loader calls it after materialising a meta-device model."""
        inv_freq = inverse_frequencies(self.cfg)
        inv_freq = inv_freq if device is None else inv_freq.to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        # [max_pos, head_dim]: both halves repeated, as HF's rotate_half convention expects.
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
