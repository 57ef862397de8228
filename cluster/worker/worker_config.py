"""What a worker needs to build its model and KV cache; frozen, handed to each actor at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    dtype: str | None = None  # None: the checkpoint's
    device: str = "cpu"  # "cuda" inside a GPU actor (Ray sets CUDA_VISIBLE_DEVICES)
    attention_backend: str = "torch"
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_memory_fraction of free GPU memory
    kv_memory_fraction: float = 0.85  # of the memory free after the weights load
    # vLLM's --gpu-memory-utilization: the fraction of this worker's share of the GPU that weights,
    # activations and KV may take together (None: size the KV by kv_memory_fraction instead).
    gpu_memory_utilization: float | None = None
    gpu_share: float = 1.0  # fraction of the GPU this worker owns (< 1 when actors share one GPU)
    cpu_num_blocks: int = 512  # the pool on CPU, where free memory says little
    max_num_seqs: int = 128
    max_prefill_tokens: int = 4096
    # Decode worker: at most this many local-prefill tokens between two decode steps while requests
    # are decoding (all of max_prefill_tokens when none is), so a long local prompt costs the running
    # requests a bounded stall per step instead of its whole prefill at once. Below it, each pass takes
    # what costs about one decode step by the measured rates (decode_worker/local_prefill_pacer.py).
    local_prefill_chunk_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True  # freed full KV blocks stay findable by content (cluster.kv.block_pool)
    # Decode graphs: "vllm" ([1,2,4] + 8..248 step 8 + 256.. step 16), "pow2", or explicit sizes.
    graph_buckets: str | tuple[int, ...] = "vllm"
    use_cuda_graph: bool = True
    # Prefill worker: passes of at most this many tokens replay CUDA graphs captured at token buckets
    # (cluster/engine/prefill_graph_runner.py; one GPU, triton attention); longer ones run eagerly. 0: all eager.
    prefill_graph_max_tokens: int = 512
    # Prefill worker: launch a short (graph-replayed) pass while the pass ahead of it is still on the device,
    # before reading that one's first tokens (prefill_worker/launched_pass.py). "on"; "auto": on CUDA only (on
    # CPU a pass runs as it is launched: the pass ahead's first tokens would wait for it); "off" (the default
    # until a GPU run measures it: issue 35's closing notes).
    prefill_overlap: str = "off"
    seed: int = 0
    # Ranks of the worker's tensor-parallel group, one process (one GPU) each; this process is rank 0
    # (cluster/distributed/tp_group.py). 1: the worker is this one process.
    tensor_parallel_size: int = 1
    quantization: str | None = None  # "fp8": quantize the float checkpoint's weights at load (None: as stored)
    kv_cache_dtype: str = "auto"  # cluster.kv.kv_cache.resolve_kv_cache_dtype: "auto" | "fp8" | "fp8_e4m3"
    # Decode worker: a loop that raised more often than this (each time its requests are moved) stays
    # down, and the worker reports itself unhealthy.
    max_loop_restarts: int = 3
    # The cluster's secret (cluster/wire/frame_auth.py): the frames a worker sends on the token streams and
    # the stats sink carry a MAC under it. Drawn by the launcher, handed over through Ray; never printed.
    cluster_secret: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        if self.prefill_overlap not in ("auto", "on", "off"):
            raise ValueError(f"prefill_overlap must be 'auto', 'on' or 'off', got {self.prefill_overlap!r}")
