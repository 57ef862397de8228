"""Batched sampling on the device with per-row parameters and no host synchronisation.

Randomness is counter-based: row r's noise over the vocabulary is a hash of (seed_r, position_r,
token id) (cluster.kernels.reference.uniform_noise). So a seeded request samples the same tokens
whatever batch it shares and on whichever worker samples it (engine, prefill worker, decode worker on
the same device run the same code), a CUDA graph can replay sampling (no generator state to advance
on the host) and nothing is read back until the caller wants the token ids.

On CUDA this is one Triton kernel reading the logits once per row (a few times for rows with
top-k/top-p), no sort and no [B, V] temporaries (cluster/kernels/sampling.py); elsewhere its torch
reference, the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster import kernels
from cluster.kernels.reference import uniform_noise
from cluster.sampling_params import SamplingParams

__all__ = ["SamplingTensors", "sample", "sample_tokens", "uniform_noise"]


@dataclass
class SamplingTensors:
    """Per-row parameters on the device. The graph runner keeps static instances of these."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int, <= 0 = disabled
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], device) -> "SamplingTensors":
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            # Clamped to int32 (the kernel's type): any k at or above the vocabulary means no limit.
            top_k=torch.tensor([min(p.top_k, 2**31 - 1) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        )


def sample(
    logits: torch.Tensor,  # [B, V], any float dtype
    st: SamplingTensors,
    positions: torch.Tensor,  # [B]: position of the token being sampled (drives the noise)
    use_top_k_top_p: bool | None = None,  # host-side hint: some row filters (the CPU path skips a sort if not)
) -> torch.Tensor:  # [B] int64
    """Greedy rows: argmax. Others: a draw from softmax(logits / T) over their top-k/top-p set, by
    Gumbel-max (argmax of logits / T plus the row's counter-based Gumbel noise)."""
    return kernels.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, positions, use_top_k_top_p)


def sample_tokens(logits: torch.Tensor, params: "list[SamplingParams]", seeds: list[int],
                  positions: list[int]) -> list[int]:
    """THE host-side sampling rule after a prefill (a prompt's first token, or the next token of a
    recomputed sequence) and in the reference engine: row i samples the token at position
    `positions[i]` (= the tokens before it) with its own parameters and seed. Every path that samples
    outside the decode worker's graph calls this, so a seeded request draws the same first token
    wherever it is prefilled; on one device it is the same function the decode graph runs. Syncs
    (returns host ints)."""
    st = SamplingTensors.from_params(params, seeds, logits.device)
    pos = torch.tensor(positions, device=logits.device)
    return sample(logits, st, pos, any(p.needs_top_k_top_p for p in params)).tolist()
