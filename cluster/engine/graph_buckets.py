"""The CUDA-graph bucket rule: which batch sizes a decode worker captures, and which captured graph a
batch of n rows replays in.

One place for both sides of it: the decode worker's BucketedGraphRunner pads every step by
`padded_size` (and captures `bucket_sizes`), and the router's placement judges the padding a new
request would cause by `padding_fraction` over the buckets the worker reported in
`WorkerStats.graph_buckets` (never recomputed from the config). Pure Python, no torch.

A batch of n rows runs in the smallest bucket >= n; above the largest bucket it runs eagerly,
unpadded. Buckets are ascending batch sizes.

The decode step's features variant (logits processing, state update, logprobs: replayed only for a
batch where some row asks for them) is captured at a coarser subset, `feature_bucket_sizes`: a
features batch pads to it. Half the graphs (capture time) for ~10 % more padded rows on the
batches that need the variant, which are the rarer ones.

Prefill passes have their own rule (`prefill_token_buckets`, `prefill_graph_seqs`): a short pass of T
tokens over S prompts replays the graph of the smallest token bucket >= T when S fits that bucket's
prompt rows (cluster/engine/prefill_graph_runner.py); a longer pass, or one of more prompts, runs eagerly.
"""

from __future__ import annotations

from typing import Iterable
from typing import Sequence as Seq


def bucket_sizes(policy: str | Seq[int], max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending, none above max_num_seqs: "vllm" (1, 2, 4, then every 8 up
    to 256, then every 16), "pow2", or explicit sizes."""
    if isinstance(policy, str):
        if policy == "vllm":
            sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_num_seqs + 1, 16))
        elif policy == "pow2":
            sizes = [1 << i for i in range(max_num_seqs.bit_length())]
        else:
            raise ValueError(f"unknown graph bucket policy {policy!r}: use 'vllm', 'pow2' or a list of sizes")
        sizes = [s for s in sizes if s <= max_num_seqs]
        if sizes[-1] != max_num_seqs:
            sizes.append(max_num_seqs)  # so that no batch the scheduler can form runs eagerly
    else:
        sizes = sorted({int(s) for s in policy})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"graph buckets must be positive batch sizes, got {list(policy)}")
        sizes = [s for s in sizes if s <= max_num_seqs] or [max_num_seqs]
    return sizes


def feature_bucket_sizes(sizes: Seq[int]) -> list[int]:
    """The subset of `sizes` the features variant is captured at: powers of two, multiples of 32
    and the largest (so a features batch runs eagerly exactly when a plain one would)."""
    sizes = sorted(sizes)
    return [s for s in sizes if s & (s - 1) == 0 or s % 32 == 0 or s == sizes[-1]]


def bucket_for(sizes: Seq[int], n: int) -> int | None:
    """The bucket a batch of n rows replays in: the smallest one holding n rows, or None if n exceeds
    the largest (the batch runs eagerly)."""
    for s in sizes:
        if s >= n:
            return s
    return None


def padded_size(sizes: Seq[int], n: int) -> int:
    """Rows a batch of n rows computes: its bucket, or n itself when it runs eagerly."""
    return bucket_for(sizes, n) or n


def padding_fraction(sizes: Seq[int], n: int) -> float:
    """Fraction of the rows a batch of n computes that are padding (0 when it fits a bucket exactly,
    runs eagerly, or is empty)."""
    if n <= 0:
        return 0.0
    b = padded_size(sizes, n)
    return (b - n) / b


def padding_waste(sizes: Seq[int], batch_sizes: Iterable[int]) -> float:
    """Fraction of computed rows that are padding over a mix of batch sizes (eager batches pad none)."""
    batch_sizes = list(batch_sizes)
    padded = sum(padded_size(sizes, n) for n in batch_sizes)
    return (padded - sum(batch_sizes)) / padded if padded else 0.0


# Most prompts one graphed prefill pass holds: the captured LM head computes this many rows, and the
# attention grid has a tile for each (cluster/engine/prefill_graph_runner.py).
PREFILL_GRAPH_MAX_SEQS = 64


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Token counts the prefill graphs are captured at, ascending: 16, 32, 64, 128, then every 64, the
    largest max_tokens itself (none for max_tokens 0). Below ~512 tokens a pass's device time is mostly
    reading the weights once, so padding to the next bucket costs little."""
    if max_tokens <= 0:
        return []
    sizes = [16, 32, 64, 128] + list(range(192, max_tokens, 64))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def prefill_graph_seqs(bucket: int) -> int:
    """Prompts a prefill pass in this token bucket may hold (each has at least one token)."""
    return min(bucket, PREFILL_GRAPH_MAX_SEQS)


def prefill_bucket_for(sizes: Seq[int], num_tokens: int, num_seqs: int) -> int | None:
    """The token bucket a prefill pass replays in, or None: it runs eagerly (more tokens than the
    largest bucket, or more prompts than its bucket's rows)."""
    b = bucket_for(sizes, num_tokens)
    return b if b is not None and 0 < num_seqs <= prefill_graph_seqs(b) else None
