"""Rotary position embedding, including Llama-3's frequency rescaling.

The cos/sin table is computed once in float32 for every position the model supports, so a forward
pass only indexes rows by position: no per-step trigonometry and no host work.
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
    """The cos/sin table [max_positions, head_dim]: cos of the head_dim/2 frequencies, then their sin.

    Computed once in float32 and stored in the activation dtype (the dtype torch would cast it to per
    call), so a forward pass only indexes rows by position: no trigonometry, no cast, no host work.
    Rotating q/k with it is `cluster.kernels.rotary_store_kv`'s job (fused with the KV write)."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.build_tables(None)  # on the default device (meta inside the loader)

    def build_tables(self, device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> None:
        """(Re)computes the table; the loader calls it after materialising a meta-device model."""
        if torch.device(device or torch.get_default_device()).type == "meta":
            # Shape only. Arithmetic on meta tensors runs torch._refs, whose first call imports
            # torch._dynamo: ~0.6 s of CPU in each worker process on an idle machine, 3-4 s on a busy one.
            self.cos_sin = torch.empty(self.max_positions, self.cfg.head_dim, dtype=dtype, device="meta")
            return
        inv_freq = inverse_frequencies(self.cfg)
        inv_freq = inv_freq if device is None else inv_freq.to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
