"""How a Llama-family model splits over a tensor-parallel group of N ranks (Megatron's layout), and the
one check that a model can be split that way (`check_tensor_parallel`).

Per decoder layer (rank r of N):
- q heads: an even split, heads [r * H / N, (r + 1) * H / N) (H % N == 0);
- KV heads: an even split when K >= N (K % N == 0); when K < N (GQA with few KV heads: 8 KV heads at
  TP 16, Mistral's 1 at TP 2), each rank holds the one KV head its q heads read, r * K // N, so every
  KV head is replicated on N / K ranks (N % K == 0). Either way a rank's q heads only ever read its own
  KV heads: q head j reads KV head j // (H / K);
- the MLP: intermediate rows [r * I / N, (r + 1) * I / N) (I % N == 0);
- the LM head: vocabulary rows [r * Vs, (r + 1) * Vs) with Vs = ceil(V / N) (the last rank's range is
  padded with zero rows, its logits cut off after the gather).
The embedding, the norms and everything outside the decoder's matmuls are replicated.

The KV cache of a rank holds its KV heads only: [layers, 2, blocks, block_size, local KV heads, head_dim]
(`TPShard.kv_heads`: which global heads, in order). A KV transfer between groups of different sizes maps
heads between ranks with `kv_heads_of_rank` (cluster/transport: the head mapping).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import ModelLoadError


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The global KV heads rank `rank` of a group of `size` holds (replicated ones when K < N)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    h = rank * num_kv_heads // size
    return range(h, h + 1)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int,
                          what: str = "the model") -> None:
    """Raises ModelLoadError (one line, naming the numbers) if a group of `size` ranks cannot split the
    model: q heads and the MLP split evenly, KV heads split evenly or are replicated evenly."""
    if size < 1:
        raise ModelLoadError(f"tensor parallel size must be at least 1, got {size}")
    if size == 1:
        return
    if num_heads % size:
        raise ModelLoadError(f"tensor parallel size {size} does not divide the {num_heads} attention heads of {what}")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ModelLoadError(f"tensor parallel size {size} does not divide the {num_kv_heads} KV heads of {what}")
    if num_kv_heads < size and size % num_kv_heads:
        raise ModelLoadError(f"{what} has {num_kv_heads} KV heads: to replicate them over {size} ranks, the tensor "
                             f"parallel size must be a multiple of {num_kv_heads}")
    if intermediate_size % size:
        raise ModelLoadError(f"tensor parallel size {size} does not divide the MLP's {intermediate_size} rows of {what}")


@dataclass(frozen=True)
class TPShard:
    """One rank's part of the model: every size and offset the sharded layers and the loader need."""

    rank: int
    size: int
    head_dim: int
    num_heads: int  # this rank's q heads
    head_start: int  # its first (global) q head
    kv_heads: range  # the global KV heads it holds
    intermediate_size: int  # its MLP rows
    intermediate_start: int
    vocab_size: int  # the model's (global)
    vocab_shard: int  # LM-head rows per rank (ceil(V / N)): the last rank's are padded

    @classmethod
    def of(cls, arch, rank: int, size: int) -> "TPShard":
        """arch: a cluster.model.config.ModelArchConfig (checked with check_tensor_parallel)."""
        check_tensor_parallel(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} of a group of {size}")
        heads, inter = arch.num_heads // size, arch.intermediate_size // size
        return cls(rank, size, arch.head_dim, heads, rank * heads, kv_heads_of_rank(arch.num_kv_heads, size, rank),
                   inter, rank * inter, arch.vocab_size, -(-arch.vocab_size // size))

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def q_rows(self) -> tuple[int, int]:
        """(start, size) of this rank's rows of the checkpoint's q_proj (and columns of o_proj)."""
        return self.head_start * self.head_dim, self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        """(start, size) of this rank's rows of the checkpoint's k_proj / v_proj."""
        return self.kv_heads.start * self.head_dim, self.num_kv_heads * self.head_dim

    @property
    def mlp_rows(self) -> tuple[int, int]:
        """(start, size) of this rank's rows of gate_proj / up_proj (and columns of down_proj)."""
        return self.intermediate_start, self.intermediate_size

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """(start, end) of the vocabulary rows this rank's LM head computes; end - start may be less than
        vocab_shard on the last rank (the rest is padding)."""
        start = self.rank * self.vocab_shard
        return min(start, self.vocab_size), min(start + self.vocab_shard, self.vocab_size)
