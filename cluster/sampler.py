"""Batched sampling on the device with per-row parameters and no host synchronisation.

Randomness is counter-based: row r's noise over the vocabulary is a hash of (seed_r, position_r,
token id). So a seeded request samples the same tokens whatever batch it shares, a CUDA graph can
replay sampling (no generator state to advance on the host) and nothing is read back until the
caller wants the token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _to_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_MIX1 = _to_signed(0xBF58476D1CE4E5B9)
_MIX2 = _to_signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, position, token id)."""
    row = _splitmix64(seeds.long() * 1_000_003 + positions.long())
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _splitmix64(row[:, None] ^ (cols[None, :] * _GOLDEN))
    return (_shr(bits, 40).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row parameters on the device. The graph runner keeps static instances of these."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, <= 0 = disabled
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], device) -> "SamplingTensors":
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        )


def sample(
    logits: torch.Tensor,  # [B, V] float32
    st: SamplingTensors,
    positions: torch.Tensor,  # [B]: position of the token being sampled (drives the noise)
    use_top_k_top_p: bool,  # host-side flag: skips the sort when no row filters
) -> torch.Tensor:  # [B] int64
    greedy = logits.argmax(dim=-1)
    temp = st.temperature.clamp(min=1e-5)[:, None]
    scaled = logits / temp
    if use_top_k_top_p:
        scaled = _apply_top_k_top_p(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(dim=-1)
    # Exponential race (Gumbel-max in another form): argmax(p / E), E ~ Exp(1), samples from p.
    noise = -torch.log(uniform_noise(st.seeds, positions, logits.shape[-1]))
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(st.temperature == 0, greedy, sampled)


def sample_tokens(logits: torch.Tensor, params: "list[SamplingParams]", seeds: list[int],
                  positions: list[int]) -> list[int]:
    """THE host-side sampling rule after a prefill (a prompt's first token, or the next token of a
    recomputed sequence) and in the reference engine: row i samples the token at position
    `positions[i]` (= the tokens before it) with its own parameters and seed. Every path that samples
    outside the decode worker's graph calls this, so a seeded request draws the same first token
    wherever it is prefilled. Syncs (returns host ints)."""
    st = SamplingTensors.from_params(params, seeds, logits.device)
    pos = torch.tensor(positions, device=logits.device)
    return sample(logits, st, pos, any(p.needs_top_k_top_p for p in params)).tolist()


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k <= 0, vocab, top_k)[:, None]
    drop = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
