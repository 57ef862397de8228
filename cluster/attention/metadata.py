"""What an attention backend needs to know about one forward pass, besides q/k/v.

The decode fields are device tensors of a fixed shape, so the decode worker's graph runner can keep
one static instance per bucket and only rewrite its contents. The prefill fields include host lists
because prefill runs eagerly with variable shapes and already knows every length on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot (block * block_size + offset) each new token's K/V goes to.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks] int32 or int64: the KV blocks of each sequence, padded with the null block.
    block_tables: torch.Tensor
    # [num_seqs] int32 or int64: KV length of each sequence after this pass (cached + new tokens).
    context_lens: torch.Tensor
    is_prefill: bool = False
    # Prefill only (host side): new tokens per sequence and KV length per sequence.
    query_lens: tuple[int, ...] = ()
    context_lens_host: tuple[int, ...] = ()
    # Set by the backend's plan() once per pass (prefill only): e.g. the Triton kernel's work list.
    prefill_plan: tuple[torch.Tensor, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]
