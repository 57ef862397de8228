"""Turns host-side batches into model inputs and runs the eager forward passes.

Shared by the in-process engine, the prefill worker (packed variable-length prefill) and the
decode worker (whose graph runner reuses `build_decode_metadata` for its eager fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from cluster.attention import AttentionMetadata
from cluster.kv_cache import NULL_BLOCK, KVCacheSpec
from cluster.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class PrefillChunk:
    token_ids: Seq[int]  # the tokens computed in this pass
    start: int  # tokens of this sequence already in the cache (> 0 for a later chunk)
    block_table: Seq[int]  # blocks covering at least start + len(token_ids) tokens


def pad_block_tables(tables: Seq[Seq[int]], width: int) -> list[list[int]]:
    return [list(t) + [NULL_BLOCK] * (width - len(t)) for t in tables]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, spec: KVCacheSpec, device: str | torch.device, kv_cache: torch.Tensor | None = None):
        self.model = model
        self.spec = spec
        self.device = torch.device(device)
        self.kv_cache = kv_cache if kv_cache is not None else spec.allocate(self.device)
        model.bind_kv_cache(self.kv_cache)

    def build_prefill_inputs(self, chunks: Seq[PrefillChunk]):
        bs = self.spec.block_size
        ids, pos, slots = [], [], []
        for c in chunks:
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            rng = range(c.start, c.start + n)
            pos.extend(rng)
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in rng)
        width = max(self.spec.blocks_for_tokens(c.start + len(c.token_ids)) for c in chunks)
        tables = pad_block_tables([c.block_table[:width] for c in chunks], width)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor([c.start + len(c.token_ids) for c in chunks], dtype=torch.int32, device=dev),
            is_prefill=True,
            query_lens=tuple(len(c.token_ids) for c in chunks),
            context_lens_host=tuple(c.start + len(c.token_ids) for c in chunks),
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev), meta

    @torch.inference_mode()
    def prefill(self, chunks: Seq[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        """One packed forward over every chunk (no padding); logits of each chunk's last token
        ([num_chunks, vocab]), or of every token with all_logits=True ([num_tokens, vocab])."""
        ids, pos, meta = self.build_prefill_inputs(chunks)
        hidden = self.model(ids, pos, meta)
        if not all_logits:
            last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden)

    def build_decode_metadata(self, positions: Seq[int], block_tables: Seq[Seq[int]], width: int | None = None):
        """positions[i]: position of row i's input token (its KV goes to that slot)."""
        bs = self.spec.block_size
        width = width or max(len(t) for t in block_tables)
        slots = [t[p // bs] * bs + p % bs for p, t in zip(positions, block_tables)]
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(pad_block_tables(block_tables, width), dtype=torch.int32, device=dev),
            context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
        )

    @torch.inference_mode()
    def decode(self, token_ids: Seq[int], positions: Seq[int], block_tables: Seq[Seq[int]]) -> torch.Tensor:
        """One eager decode step: one token per sequence; returns logits [B, vocab]."""
        meta = self.build_decode_metadata(positions, block_tables)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(self.model(ids, pos, meta))
