"""The tensor-parallel layers (Megatron's): a rank holds its part of each weight and loads only that.

- `ColumnParallelLinear` (fused QKV, fused gate/up): the output rows split over the group; each fused
  part (q, k, v or gate, up) contributes its own rows to the rank's matmul (`TPShard` says which; KV rows
  repeat on several ranks when KV heads are replicated). No communication: its output feeds the rank's
  attention heads or its SiLU*mul.
- `RowParallelLinear` (o_proj, down_proj): the input columns split; each rank computes a partial sum
  of the full output and one all-reduce adds them (TPCommunicator: one-shot at decode sizes, NCCL
  above). A bias is added by rank 0 alone, before the sum (as vLLM's).
- `ParallelLMHead`: vocabulary-parallel. Why not replicated: the LM head (V x H, 1.05 GB for the 8B
  shape in bf16) is the largest single matrix a decode step reads; replicated, every rank would read all
  of it (+13 % of a TP-2 rank's 8 GB); split, each reads 1/N of it and one all-gather per pass
  ([tokens, V / N] per rank: 256 KB at batch 1) assembles the logits. Every rank then holds the same
  logits bit for bit (an all-gather copies), so the sampler, unchanged, draws the same token on every
  rank from the same seeded counter hash: no token is broadcast.
  The embedding stays replicated (cluster/model/llama.py): a lookup reads only the batch's rows, so
  splitting it would save memory but add an all-reduce per pass. Tied embeddings: the LM head's rows are
  a view of the embedding's (a copy where V % N leaves the last rank padding rows).

FP8 composes: the FP8 method (cluster/model/linear.py) creates the rank's parameters at its local sizes
and runs its matmul unchanged; `checkpoint_index` cuts every checkpoint tensor along the weight's rows
(column-parallel) or columns (row-parallel) with the method's `granularity`: channel scales follow the
rows (split on column-parallel layers, whole on row-parallel ones), 128 x 128 block scales follow both
(a rank's part must then start and end on a block), per-tensor and input scales are one value each.
With `--quantization fp8` a row-parallel rank computes its per-row scales over its own columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cluster.distributed.communicator import TPCommunicator
from cluster.distributed.sharding import TPShard
from cluster.errors import ModelLoadError
from cluster.model.linear import Linear, LinearMethod


@dataclass(frozen=True)
class TensorParallel:
    """What a model built for one rank of a tensor-parallel group needs: its shard and its collectives."""

    shard: TPShard
    comm: TPCommunicator

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size


def _split(start: int, size: int, full: int, granularity: int | None, extent: int, what: str) -> slice:
    """The slice of a checkpoint dimension of `extent` elements, each covering `granularity` weight
    rows (or columns) of `full`, that holds weight rows [start, start + size)."""
    if granularity is None or granularity == 1:
        if extent != full:
            raise ModelLoadError(f"{what}: checkpoint dimension of {extent}, expected {full}")
        return slice(start, start + size)
    if start % granularity or (size % granularity and start + size != full):
        raise ModelLoadError(f"{what}: this rank's rows [{start}, {start + size}) do not fall on the checkpoint's "
                             f"{granularity}-row blocks; choose a tensor parallel size that keeps them aligned")
    if extent != -(-full // granularity):
        raise ModelLoadError(f"{what}: checkpoint dimension of {extent} blocks, expected {-(-full // granularity)}")
    return slice(start // granularity, -(-(start + size) // granularity))


class ColumnParallelLinear(Linear):
    """Output rows split. `parts`, one per fused part in shard_ids order: (rows of the checkpoint's
    tensor, first row this rank takes, rows it takes)."""

    def __init__(self, input_size: int, parts: Sequence[tuple[int, int, int]], bias: bool, method: LinearMethod,
                 dtype: torch.dtype, shard_ids: Sequence[str | int] | None = None):
        try:
            super().__init__(input_size, [n for _, _, n in parts], bias, method, dtype, shard_ids)
        except ModelLoadError as e:  # the method's own checks, on this rank's part sizes
            raise ModelLoadError(f"{e}: this rank's part of each fused layer under tensor parallelism; choose a "
                                 "tensor parallel size that keeps them aligned") from None
        self.parts = tuple(tuple(p) for p in parts)

    def _part(self, shard) -> tuple[int, int, int]:
        return self.parts[0] if shard is None else self.parts[self.shard_ids.index(shard)]

    def checkpoint_index(self, name, shard, shape):
        if len(shape) == 0 or all(d == 1 for d in shape):
            return tuple(slice(None) for _ in shape)  # one value (a per-tensor scale): every rank needs it
        full, start, size = self._part(shard)
        rows, _ = self.granularity(name)
        if rows is None:
            return tuple(slice(None) for _ in shape)
        return (_split(start, size, full, rows, shape[0], f"{name} part {shard!r}"),) + (slice(None),) * (len(shape) - 1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", column-parallel parts={self.parts}"


def _skip(layer, param, t, shard) -> None:
    """The loader of a checkpoint tensor this rank does not keep (a row-parallel bias off rank 0)."""


class RowParallelLinear(Linear):
    """Input columns split: `columns` = (the checkpoint's input columns, first one this rank takes,
    columns it takes); the rank's partial outputs are summed by one all-reduce."""

    def __init__(self, columns: tuple[int, int, int], output_size: int, bias: bool, method: LinearMethod,
                 dtype: torch.dtype, comm: TPCommunicator, rank: int):
        full, start, size = columns
        super().__init__(size, (output_size,), bias and rank == 0, method, dtype)
        self.columns = (full, start, size)
        self.comm = comm
        if bias and rank != 0:
            # The checkpoint still carries it (and must: expected()), but only rank 0 adds it.
            self._loaders["bias"] = _skip
            self._expected.append(("bias", None))

    def checkpoint_index(self, name, shard, shape):
        if name == "bias":
            return None if self.bias is None else (slice(None),)
        full, start, size = self.columns
        _, cols = self.granularity(name)
        if cols is None or len(shape) < 2 or shape[1] == 1:
            return tuple(slice(None) for _ in shape)  # channel scales ([N] / [N, 1]), one-value scales
        return (slice(None), _split(start, size, full, cols, shape[1], name)) + (slice(None),) * (len(shape) - 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.method.apply(self, x))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", row-parallel columns={self.columns}"


class ParallelLMHead(nn.Module):
    """Vocabulary-parallel LM head: this rank's `shard.vocab_shard` rows of the [V, H] weight (zero rows
    past V on the last rank); forward returns the full logits [T, V], the same on every rank."""

    def __init__(self, hidden_size: int, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = tp.shard.vocab_size
        self.weight = nn.Parameter(torch.empty(tp.shard.vocab_shard, hidden_size, dtype=dtype), requires_grad=False)

    def checkpoint_index(self, shape: tuple[int, ...]) -> tuple[slice, ...]:
        lo, hi = self.tp.shard.vocab_rows
        if shape[0] != self.vocab_size:
            raise ModelLoadError(f"lm_head.weight has {shape[0]} rows, expected the vocabulary's {self.vocab_size}")
        return slice(lo, hi), slice(None)

    def load(self, t: torch.Tensor) -> None:
        """t: this rank's rows (checkpoint_index), already cut."""
        n = t.shape[0]
        if tuple(t.shape[1:]) != tuple(self.weight.shape[1:]):
            raise ModelLoadError(f"lm_head.weight rows of {tuple(t.shape[1:])}, expected {tuple(self.weight.shape[1:])}")
        self.weight.data[:n].copy_(t.to(self.weight.dtype))
        self.weight.data[n:].zero_()

    def tie(self, embedding: torch.Tensor) -> None:
        """Tied embeddings: this rank's rows of the embedding's weight (a view when no padding is needed;
        call again once the embedding is loaded when it is a copy)."""
        lo, hi = self.tp.shard.vocab_rows
        if hi - lo == self.weight.shape[0]:
            self.weight = nn.Parameter(embedding.data[lo:hi], requires_grad=False)
        else:
            self.load(embedding.data[lo:hi])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # [T, V / N]
        parts = self.tp.comm.all_gather(local)  # [N, T, V / N]
        logits = parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size].contiguous()
