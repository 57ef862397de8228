"""Turns host-side batches into model inputs and runs the eager forward passes.

Shared by the in-process engine, the prefill worker (packed variable-length prefill; its short passes
replay CUDA graphs, `prefill_graphs`) and the decode worker (whose graph runner reuses `build_decode_metadata` for its eager fallback).

Tensor parallelism: on rank 0 of a group (`group`, a cluster.distributed.TPGroup), every pass is first
announced to the followers (a PrefillPass / EagerDecode step message), which run the same pass through
`execute` (cluster/distributed/follower.py); the model's collectives then pair up. Only rank 0 uses the
logits (the followers compute them too: the LM head's all-gather is a collective).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import numpy as np
import torch

from cluster.attention import AttentionMetadata
from cluster.distributed.step_messages import Chunk, EagerDecode, PrefillPass, PromptLogprobsWant, pack_ids, unpack_ids
from cluster.kv.kv_blocks import NULL_BLOCK
from cluster.kv.kv_cache import KVCacheSpec
from cluster.sampling.logprobs import prompt_logprobs
from cluster.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from cluster.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefillChunk:
    token_ids: Seq[int]  # the tokens computed in this pass
    start: int  # tokens of this sequence already in the cache (> 0 for a later chunk)
    block_table: Seq[int]  # blocks covering at least start + len(token_ids) tokens


def _upload(arrays: Seq[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy of several int64 arrays; returns their device views (same shapes)."""
    flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64, copy=False)
    dev = torch.from_numpy(flat).to(device)
    out, at = [], 0
    for a in arrays:
        out.append(dev[at : at + a.size].view(a.shape))
        at += a.size
    return out


def _tables(tables: Seq[Seq[int]], width: int) -> np.ndarray:
    out = np.full((len(tables), width), NULL_BLOCK, dtype=np.int64)
    for i, t in enumerate(tables):
        n = min(len(t), width)
        out[i, :n] = t[:n]
    return out


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, spec: KVCacheSpec, device: str | torch.device, kv_cache: torch.Tensor | None = None,
                 group=None):
        """group: this rank's TPGroup (rank 0 announces its passes to the followers), or None."""
        self.model = model
        self.spec = spec
        self.device = torch.device(device)
        self.kv_cache = kv_cache if kv_cache is not None else spec.allocate(self.device)
        self.group = group if group is not None and group.size > 1 else None
        self.shipment_of_pass = None  # rank 0, prefill worker: () -> the pass's KV shipment (bytes) for followers
        # A prefill worker on one GPU: a cluster.engine.prefill_graph_runner.PrefillGraphRunner that replays the
        # short passes (last-token logits only) as CUDA graphs; the passes it declines run here eagerly.
        self.prefill_graphs = None
        model.bind_kv_cache(self.kv_cache)

    # -- tensor parallelism ---------------------------------------------------------------------------
    def _announce_prefill(self, chunks: Seq[PrefillChunk], wants, all_logits: bool) -> None:
        if self.group is None or not self.group.is_leader:
            return
        ship = self.shipment_of_pass() if self.shipment_of_pass is not None else b""
        self.group.publish(PrefillPass(
            [Chunk(pack_ids(c.token_ids), c.start, pack_ids(c.block_table)) for c in chunks],
            [] if wants is None else [None if w is None else PromptLogprobsWant(pack_ids(w[0]), w[1]) for w in wants],
            all_logits, ship or b""))

    def execute(self, msg) -> None:
        """A follower: runs the pass rank 0 announced (its results stay here: only rank 0 uses them)."""
        if isinstance(msg, EagerDecode):
            self._decode(unpack_ids(msg.token_ids), unpack_ids(msg.positions), [unpack_ids(t) for t in msg.block_tables])
            return
        chunks = [PrefillChunk(unpack_ids(c.token_ids), c.start, unpack_ids(c.block_table)) for c in msg.chunks]
        if msg.wants:
            wants = [None if w is None else (unpack_ids(w.prompt), w.k) for w in msg.wants]
            self._prefill_with_prompt_logprobs(chunks, wants)
        else:
            self._prefill(chunks, msg.all_logits)

    def build_prefill_inputs(self, chunks: Seq[PrefillChunk]):
        """(input_ids, positions, metadata, index of each chunk's last token), uploaded in one copy."""
        bs = self.spec.block_size
        q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        ctx = starts + q_lens
        total = int(q_lens.sum())
        width = int(-(-ctx.max() // bs))
        tables = _tables([c.block_table for c in chunks], width)
        ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=total)
        seq = np.repeat(np.arange(len(chunks)), q_lens)
        first = np.cumsum(q_lens) - q_lens
        pos = np.arange(total, dtype=np.int64) - np.repeat(first, q_lens) + np.repeat(starts, q_lens)
        slots = tables[seq, pos // bs] * bs + pos % bs
        last = first + q_lens - 1
        ids_d, pos_d, slots_d, tables_d, ctx_d, last_d = _upload([ids, pos, slots, tables, ctx, last], self.device)
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            block_tables=tables_d,
            context_lens=ctx_d,
            is_prefill=True,
            query_lens=tuple(q_lens.tolist()),
            context_lens_host=tuple(ctx.tolist()),
        )
        return ids_d, pos_d, meta, last_d

    def prefill(self, chunks: Seq[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        """One packed forward over every chunk (no padding); logits of each chunk's last token
        ([num_chunks, vocab]), or of every token with all_logits=True ([num_tokens, vocab])."""
        self._announce_prefill(chunks, None, all_logits)
        return self._prefill(chunks, all_logits)

    @torch.inference_mode()
    def _prefill(self, chunks: Seq[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        if not all_logits and self.prefill_graphs is not None:
            logits = self.prefill_graphs.run(chunks)
            if logits is not None:
                return logits
        ids, pos, meta, last = self.build_prefill_inputs(chunks)
        hidden = self.model(ids, pos, meta)
        return self.model.compute_logits(hidden if all_logits else hidden[last])

    def prefill_with_prompt_logprobs(self, chunks: Seq[PrefillChunk], wants: Seq[tuple[Seq[int], int] | None]):
        """prefill(chunks) -> (last-token logits [num_chunks, vocab], per chunk: None, or for
        wants[i] = (prompt, k) the logprobs of the prompt tokens its positions predict
        (cluster.sampling.logprobs.prompt_logprobs), from the chunk's hidden states a slice at a time).
        Without any want it is prefill(chunks) and Nones."""
        if all(w is None for w in wants):
            return self.prefill(chunks), [None] * len(chunks)
        self._announce_prefill(chunks, wants, False)
        return self._prefill_with_prompt_logprobs(chunks, wants)

    def prefill_sequences(self, chunks: Seq[tuple["Sequence", PrefillChunk]]) -> torch.Tensor:
        """A scheduler's prefill pass over (sequence, chunk) pairs -> last-token logits [num_chunks, vocab].
        A sequence that asked for prompt logprobs gets this chunk's appended to seq.prompt_logprobs, on
        its first prefill only (a recompute after preemption has sent them: it has output tokens)."""
        wants = [(s.prompt_token_ids, s.params.prompt_logprobs)
                 if s.params.prompt_logprobs is not None and not s.output_token_ids else None for s, _ in chunks]
        logits, prompt_lps = self.prefill_with_prompt_logprobs([c for _, c in chunks], wants)
        for (seq, _), lps in zip(chunks, prompt_lps):
            if lps is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or []) + lps
        return logits

    @torch.inference_mode()
    def _prefill_with_prompt_logprobs(self, chunks, wants):
        ids, pos, meta, last = self.build_prefill_inputs(chunks)
        hidden = self.model(ids, pos, meta)
        logits = self.model.compute_logits(hidden[last])
        out, first = [], 0
        for c, want in zip(chunks, wants):
            n = len(c.token_ids)
            if want is None:
                out.append(None)
            else:
                h = hidden[first : first + n]
                out.append(prompt_logprobs(lambda a, b, h=h: self.model.compute_logits(h[a:b]), n, want[0], c.start,
                                           want[1]))
            first += n
        return logits, out

    def build_decode_metadata(self, positions: Seq[int], block_tables: Seq[Seq[int]], width: int | None = None,
                              token_ids: Seq[int] | None = None):
        """positions[i]: position of row i's input token (its KV goes to that slot). With token_ids,
        returns (input_ids, positions, metadata), all from one host-to-device copy."""
        bs = self.spec.block_size
        width = width or max(len(t) for t in block_tables)
        tables = _tables(block_tables, width)
        pos = np.asarray(positions, dtype=np.int64)
        slots = tables[np.arange(len(pos)), pos // bs] * bs + pos % bs
        ids = np.asarray(token_ids if token_ids is not None else [], dtype=np.int64)
        ids_d, pos_d, slots_d, tables_d, ctx_d = _upload([ids, pos, slots, tables, pos + 1], self.device)
        meta = AttentionMetadata(slot_mapping=slots_d, block_tables=tables_d, context_lens=ctx_d)
        return meta if token_ids is None else (ids_d, pos_d, meta)

    def decode(self, token_ids: Seq[int], positions: Seq[int], block_tables: Seq[Seq[int]]) -> torch.Tensor:
        """One eager decode step: one token per sequence; returns logits [B, vocab]."""
        if self.group is not None and self.group.is_leader:
            self.group.publish(EagerDecode(pack_ids(token_ids), pack_ids(positions), [pack_ids(t) for t in block_tables]))
        return self._decode(token_ids, positions, block_tables)

    @torch.inference_mode()
    def _decode(self, token_ids, positions, block_tables) -> torch.Tensor:
        ids, pos, meta = self.build_decode_metadata(positions, block_tables, token_ids=token_ids)
        return self.model.compute_logits(self.model(ids, pos, meta))
