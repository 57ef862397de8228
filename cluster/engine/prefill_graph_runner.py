"""PrefillGraphRunner: a short prefill pass (a small prompt, a cached prefix's tail, a chunk's tail)
replays one CUDA graph instead of launching every layer's kernels from Python.

An eager pass of the 1B shape costs ~11 ms of host launches whatever its length, against ~1.5 ms of
device work for 128 tokens; long prompts hide the launches behind their compute, short ones do not.
Prompts stay packed and variable-length; only the pass's token count is padded.

- Buckets: cluster.engine.graph_buckets (`prefill_token_buckets`: 16, 32, 64, 128, then every 64 up to
  WorkerConfig.prefill_graph_max_tokens). A pass of T tokens over S prompts replays the smallest bucket
  b >= T whose prompt rows (`prefill_graph_seqs(b)`) hold S (`prefill_bucket_for`); any other pass -
  longer, more prompts, prompt logprobs (every position's logits), or any pass before capture - is
  declined (`run` returns None) and the caller runs it eagerly (ModelRunner._prefill).
- The whole pass is one graph, attention included: the packed prefill attention kernel
  (cluster/kernels/prefill_attention.py) reads cu_query_lens, its tile list, context lengths and block
  tables from device memory; its grid (heads x tiles) and scratch row are the only host values, fixed
  per bucket: `max_tiles(b, rows)` tiles, the unused ones naming the padding sequence (row `rows`: no
  queries, no keys), whose programs return at once. The backend's plan() keeps the plan it is given.
- Padding tokens (T..b): token 0 at position 0, K/V written to slot 0 of NULL_BLOCK (as the decode
  runner's padding rows), in no sequence: no attention tile covers them, so their attention output is
  whatever the buffer held. Every other op of a layer is row-wise (FP8 activations are scaled per
  token), so their values never reach a real row, and nothing reads them.
- Inputs: one pinned int64 staging buffer, filled on the host (numpy, no per-token Python) and sent by
  one non-blocking copy into the static device buffer whose views, at the bucket's fixed offsets, the
  graph reads; the block tables then go to the static [rows + 1, max_blocks] table with one device
  copy of the pass's columns. Columns past a prompt's blocks may hold stale block ids: every kernel
  masks positions >= the context length.
- Output: each prompt's last-token logits [S, vocab], copied out of the graph's buffer (the next replay
  overwrites it). No host sync anywhere in a pass.
- Graphs are captured largest bucket first into one memory pool when the worker starts, never while
  serving. On CPU (tests) the same padded pass runs without capture.
- One GPU only: under tensor parallelism the followers run the announced pass eagerly, so rank 0 must
  too (`eager_reason`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import numpy as np
import torch

from cluster.attention import AttentionMetadata
from cluster.engine.graph_buckets import PREFILL_GRAPH_MAX_SEQS, prefill_bucket_for, prefill_graph_seqs, prefill_token_buckets
from cluster.kernels.prefill_attention import max_tiles, tile_plan
from cluster.kv.kv_cache import NULL_BLOCK

if TYPE_CHECKING:
    from cluster.model.llama import LlamaForCausalLM
    from cluster.engine.model_runner import PrefillChunk
    from cluster.worker.worker_config import WorkerConfig


@dataclass(frozen=True)
class PassLayout:
    """Where one bucket's inputs sit in the packed int64 buffer (offsets in words)."""
    tokens: int  # the bucket: token rows of the pass
    rows: int  # prompt rows; row `rows` is the padding sequence the unused tiles name
    tiles: int  # the attention grid's tiles

    @property
    def ids(self) -> slice:
        return slice(0, self.tokens)

    @property
    def positions(self) -> slice:
        return slice(self.tokens, 2 * self.tokens)

    @property
    def slots(self) -> slice:
        return slice(2 * self.tokens, 3 * self.tokens)

    @property
    def last(self) -> slice:  # each prompt's last token, the rows whose logits come back
        at = 3 * self.tokens
        return slice(at, at + self.rows)

    @property
    def context_lens(self) -> slice:  # rows + 1: the padding sequence's is 0
        at = 3 * self.tokens + self.rows
        return slice(at, at + self.rows + 1)

    @property
    def cu_query_lens(self) -> slice:  # rows + 2
        at = 3 * self.tokens + 2 * self.rows + 1
        return slice(at, at + self.rows + 2)

    @property
    def tile_list(self) -> slice:  # [2, tiles]: sequence, first query index
        at = 3 * self.tokens + 3 * self.rows + 3
        return slice(at, at + 2 * self.tiles)

    @property
    def tables(self) -> int:  # the pass's block tables, [S, width] row-major, start here
        return 3 * self.tokens + 3 * self.rows + 3 + 2 * self.tiles

    @classmethod
    def of(cls, bucket: int) -> "PassLayout":
        rows = prefill_graph_seqs(bucket)
        return cls(bucket, rows, max_tiles(bucket, rows))


class PrefillGraphRunner:
    def __init__(self, model: "LlamaForCausalLM", kv_cache: torch.Tensor, block_size: int, max_blocks_per_seq: int,
                 max_tokens: int, use_cuda_graph: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.buckets = prefill_token_buckets(max_tokens)
        self.layouts = {b: PassLayout.of(b) for b in self.buckets}
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        words = max((lay.tables + lay.rows * self.max_blocks for lay in self.layouts.values()), default=1)
        cuda = self.device.type == "cuda"
        # Static device inputs: the graphs read exactly these, forever.
        self.inputs = torch.zeros(words, dtype=torch.int64, device=self.device)
        self.block_tables = torch.full((PREFILL_GRAPH_MAX_SEQS + 1, self.max_blocks), NULL_BLOCK, dtype=torch.int64,
                                       device=self.device)
        self._host = torch.zeros(words, dtype=torch.int64, pin_memory=cuda)
        self._np = self._host.numpy()
        # NOTE: the pinned staging buffer is rewritten only after the previous pass's copy ran (this event).
        self._copied = torch.cuda.Event() if cuda else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # bucket -> its graph's output buffer [rows, vocab]
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0  # passes run here
        self.declined = 0  # passes `run` left to the eager path

    @staticmethod
    def eager_reason(cfg: "WorkerConfig", tensor_parallel: bool) -> str | None:
        """Why a worker with this config runs every prefill pass eagerly, or None: it captures graphs."""
        if cfg.prefill_graph_max_tokens <= 0:
            return "prefill_graph_max_tokens is 0"
        if not str(cfg.device).startswith("cuda"):
            return f"device {cfg.device}: CUDA graphs need a GPU"
        if cfg.attention_backend != "triton":
            return f"attention backend {cfg.attention_backend!r} runs prefill per prompt on the host (needs 'triton')"
        if tensor_parallel:
            return "tensor parallel: the followers run each announced pass eagerly"
        return None

    @classmethod
    def for_worker(cls, wm, cfg: "WorkerConfig", max_model_len: int) -> "PrefillGraphRunner":
        """A prefill worker's runner over its WorkerModel (cluster/engine/worker_model.py), captured."""
        runner = cls(wm.model, wm.runner.kv_cache, cfg.block_size, wm.spec.blocks_for_tokens(max_model_len),
                     min(cfg.prefill_graph_max_tokens, cfg.max_prefill_tokens, max_model_len))
        runner.capture()
        return runner

    # -- the captured region ----------------------------------------------------------------------
    def _views(self, lay: PassLayout):
        x = self.inputs
        return (x[lay.ids], x[lay.positions], x[lay.slots], x[lay.last], x[lay.context_lens], x[lay.cu_query_lens],
                x[lay.tile_list].view(2, lay.tiles))

    def _forward(self, lay: PassLayout, query_lens: tuple[int, ...] = (), context_lens: tuple[int, ...] = ()):
        """One padded pass over the static inputs -> logits [rows, vocab]. query_lens/context_lens (the
        host's) serve the torch reference attention only (CPU); the kernel reads the device plan."""
        ids, pos, slots, last, ctx, cu, tiles = self._views(lay)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=self.block_tables[: lay.rows + 1], context_lens=ctx,
                                 is_prefill=True, query_lens=query_lens, context_lens_host=context_lens,
                                 prefill_plan=(cu, tiles))
        hidden = self.model(ids, pos, meta)
        return self.model.compute_logits(hidden[last])

    # -- start-up ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, into one shared memory pool."""
        if not self.use_cuda_graph:
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        mem0 = torch.cuda.memory_reserved(self.device)
        for b in sorted(self.buckets, reverse=True):
            lay = self.layouts[b]
            self._stage_padding(lay)  # a pass of padding alone: every tile unused, every write to NULL_BLOCK
            self.inputs[: lay.tables].copy_(self._host[: lay.tables])
            self._forward(lay)  # warm-up: Triton compilation, cuBLAS handles, the allocator
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._logits[b] = self._forward(lay)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - mem0

    def summary(self) -> dict:
        """What the graphs are and cost (JSON-ready: the worker's warm-up info and stats)."""
        return {"buckets": list(self.buckets), "graphs": len(self.graphs), "max_seqs": PREFILL_GRAPH_MAX_SEQS,
                "capture_seconds": round(self.capture_seconds, 3), "capture_bytes": int(self.capture_bytes),
                "replays": self.replays, "declined": self.declined}

    # -- one pass ---------------------------------------------------------------------------------
    def bucket_for(self, chunks: Seq["PrefillChunk"]) -> int | None:
        """The bucket this pass replays in, or None: it runs eagerly."""
        if self.use_cuda_graph and not self.graphs:
            return None  # not captured (yet): never capture while serving
        return prefill_bucket_for(self.buckets, sum(len(c.token_ids) for c in chunks), len(chunks))

    @torch.inference_mode()
    def run(self, chunks: Seq["PrefillChunk"]) -> torch.Tensor | None:
        """Each chunk's last-token logits [len(chunks), vocab], or None when the pass does not fit a
        bucket (the caller runs it eagerly)."""
        b = self.bucket_for(chunks)
        if b is None:
            self.declined += 1
            return None
        lay = self.layouts[b]
        if self._copied is not None:
            self._copied.synchronize()  # the last pass's copy has left the staging buffer (long since, normally)
        words, width, q_lens, ctx = self.stage(chunks, lay)
        self.inputs[:words].copy_(self._host[:words], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        n = len(chunks)
        # The pass's tables into the static table's first `width` columns (the rest are masked: see above).
        self.block_tables[:n, :width].copy_(self.inputs[lay.tables : lay.tables + n * width].view(n, width))
        self.replays += 1
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            logits = self._logits[b]
        else:
            logits = self._forward(lay, q_lens, ctx)
        return logits[:n].clone()

    def stage(self, chunks: Seq["PrefillChunk"], lay: PassLayout) -> tuple[int, int, tuple, tuple]:
        """Fills the host staging buffer for this pass in bucket `lay` -> (words to copy, table width,
        the host's query and context lengths). The same inputs as ModelRunner.build_prefill_inputs, then
        padding: tokens past the pass's, prompt rows past its prompts, tiles past its plan."""
        bs = self.block_size
        n = len(chunks)
        q_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=n)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        ctx = starts + q_lens
        total = int(q_lens.sum())
        width = int(-(-ctx.max() // bs))
        if width > self.max_blocks:
            raise ValueError(f"a prompt needs {width} blocks, more than max_blocks_per_seq={self.max_blocks}")
        buf = self._np
        tables = buf[lay.tables : lay.tables + n * width].reshape(n, width)
        tables[:] = NULL_BLOCK
        for i, c in enumerate(chunks):
            k = min(len(c.block_table), width)
            tables[i, :k] = c.block_table[:k]
        first = np.cumsum(q_lens) - q_lens
        seq = np.repeat(np.arange(n), q_lens)
        pos = np.arange(total, dtype=np.int64) - np.repeat(first, q_lens) + np.repeat(starts, q_lens)
        ids, positions, slots = buf[lay.ids], buf[lay.positions], buf[lay.slots]
        ids[:total] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                  count=total)
        positions[:total] = pos
        slots[:total] = tables[seq, pos // bs] * bs + pos % bs
        ids[total:] = 0
        positions[total:] = 0
        slots[total:] = NULL_BLOCK * bs  # padding tokens' K/V: slot 0 of the null block
        last = buf[lay.last]
        last[:n] = first + q_lens - 1
        last[n:] = 0
        context = buf[lay.context_lens]
        context[:n] = ctx
        context[n:] = 0
        cu, tile_seq, tile_start = tile_plan(q_lens, ctx)
        cu_buf = buf[lay.cu_query_lens]
        cu_buf[: n + 1] = cu
        cu_buf[n + 1 :] = total  # rows n.. (the padding sequence's too) have no queries
        tl_buf = buf[lay.tile_list].reshape(2, lay.tiles)
        k = len(tile_seq)
        assert k <= lay.tiles, f"{k} tiles in a bucket of {lay.tiles}"  # max_tiles is a bound (prefill_attention)
        tl_buf[0, :k], tl_buf[1, :k] = tile_seq, tile_start
        tl_buf[0, k:], tl_buf[1, k:] = lay.rows, 0  # unused tiles: the padding sequence, returns at once
        return lay.tables + n * width, width, tuple(q_lens.tolist()), tuple(ctx.tolist())

    def _stage_padding(self, lay: PassLayout) -> None:
        """A pass with no prompt: the inputs capture runs on."""
        buf = self._np
        buf[lay.ids] = 0
        buf[lay.positions] = 0
        buf[lay.slots] = NULL_BLOCK * self.block_size
        buf[lay.last] = 0
        buf[lay.context_lens] = 0
        buf[lay.cu_query_lens] = 0
        tl_buf = buf[lay.tile_list].reshape(2, lay.tiles)
        tl_buf[0], tl_buf[1] = lay.rows, 0
