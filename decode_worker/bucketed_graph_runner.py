"""BucketedGraphRunner: one decode step = copy the live batch into static buffers, replay a CUDA graph.

- Buckets come from a policy ("vllm", "pow2" or explicit sizes). A batch of n rows runs in the
  smallest bucket >= n; rows n..bucket are padding that point at NULL_BLOCK (position 0, context
  length 1, slot 0 of block 0), so their K/V writes land in the reserved block and nowhere else.
- Static device buffers are allocated once. Per-row integers (input ids, previous-row index, position,
  top_k, seed) travel packed in one int64 buffer and the floats (temperature, top_p) in another, laid
  out [field, bucket] so a bucket's graph reads views of the first `fields * bucket` elements:
  two small host-to-device copies plus one for block tables per step, whatever the batch.
- Input ids come from the device: a row continuing from the previous step reads that step's sampled
  token (`out_tokens[prev_row]`) inside the graph, so the host never needs the token to launch.
- Slot mapping and context lengths are derived on the device from positions and block tables.
- Sampling runs inside the graph (cluster.sampler is sync-free). Its `use_top_k_top_p` flag is
  host-static, so each bucket is captured once per sampler variant: "greedy" (argmax only),
  "sample" (temperature + seeded noise) and "filtered" (plus the top-k/top-p sort). All share one
  memory pool; the host picks the cheapest variant that covers the batch.
- Graphs are captured largest bucket first into one shared pool at start-up, never while serving.
- Batches above the largest bucket, and everything on CPU, run the same code eagerly, padded the same.
- Host reads sampled tokens asynchronously: a pinned buffer (two slots, so step t+1's copy cannot
  overwrite step t's unread tokens) filled by a non-blocking copy and guarded by a CUDA event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from cluster.attention import AttentionMetadata
from cluster.kv_cache import NULL_BLOCK
from cluster.model.llama import LlamaForCausalLM
from cluster.sampler import SamplingTensors, sample

VARIANTS = ("greedy", "sample", "filtered")  # each covers the ones before it
_INT_FIELDS = 5  # host_ids, prev_row, positions, top_k, seeds
_FLOAT_FIELDS = 2  # temperature, top_p


def bucket_sizes(policy: str | Seq[int], max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending, none above max_num_seqs."""
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


def bucket_for(sizes: Seq[int], n: int) -> int | None:
    """Smallest bucket holding n rows, or None if n exceeds the largest."""
    for s in sizes:
        if s >= n:
            return s
    return None


def padding_waste(sizes: Seq[int], batch_sizes: Seq[int]) -> float:
    """Fraction of computed rows that are padding over a mix of batch sizes (eager batches pad none)."""
    padded = sum((bucket_for(sizes, n) or n) for n in batch_sizes)
    return (padded - sum(batch_sizes)) / padded if padded else 0.0


def choose_variant(rows_params, captured: Seq[str] = VARIANTS) -> str:
    """The cheapest sampler variant that samples every row exactly (greedy < sample < filtered)."""
    need = 0
    for p in rows_params:
        if p.needs_top_k_top_p:
            need = 2
            break
        if not p.greedy:
            need = 1
    for v in VARIANTS[need:]:
        if v in captured:
            return v
    raise ValueError(f"no captured sampler variant covers {VARIANTS[need]!r} (captured: {list(captured)})")


@dataclass
class StepInfo:
    batch_size: int
    bucket: int  # rows computed (padded); equals batch_size for an unpadded eager batch
    graph: bool
    host_prepare_s: float  # filling the staging buffers and queueing the copies
    variant: str
    launch_s: float = 0.0  # graph.replay() (or the eager forward's dispatch) on the host


class StepHandle:
    """One launched step: `tokens()` waits for its sampled tokens (only this step's, not later ones)."""

    def __init__(self, runner: "BucketedGraphRunner", slot: int, info: StepInfo, start_ev, end_ev, t_launch: float):
        self.runner, self.slot, self.info = runner, slot, info
        self._start_ev, self._end_ev, self._t_launch = start_ev, end_ev, t_launch
        self._tokens: list[int] | None = None
        self.gpu_time_s = 0.0

    def ready(self) -> bool:
        return self._end_ev is None or self._end_ev.query()

    def tokens(self) -> list[int]:
        if self._tokens is None:
            if self._end_ev is not None:
                self._end_ev.synchronize()  # waits for this step only; later steps keep running
                self.gpu_time_s = self._start_ev.elapsed_time(self._end_ev) / 1e3
            self._tokens = self.runner._host_out[self.slot, : self.info.batch_size].tolist()
        return self._tokens


class BucketedGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        buckets: str | Seq[int] = "vllm",
        use_cuda_graph: bool = True,
        compile_decode: bool = False,
        variants: Seq[str] = VARIANTS,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = block_size
        self.max_bs = max_num_seqs
        self.max_blocks = max_blocks_per_seq
        self.buckets = bucket_sizes(buckets, max_num_seqs)
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        self.variants = tuple(v for v in VARIANTS if v in variants)
        if not self.variants:
            raise ValueError(f"no known sampler variant in {list(variants)}; choose from {VARIANTS}")
        self._logits_fn = self._compiled_logits() if compile_decode else self._logits
        self.compile_decode = compile_decode

        dev, mb = self.device, self.max_bs
        # Static device buffers: the graphs read and write exactly these, forever.
        self.ints = torch.zeros(_INT_FIELDS * mb, dtype=torch.int64, device=dev)
        self.floats = torch.zeros(_FLOAT_FIELDS * mb, dtype=torch.float32, device=dev)
        self.block_tables = torch.full((mb, self.max_blocks), NULL_BLOCK, dtype=torch.int32, device=dev)
        self.out_tokens = torch.zeros(mb, dtype=torch.int64, device=dev)
        # Host staging, two slots (step t+1 is prepared while step t's copies may still be queued).
        pin = self.device.type == "cuda"
        self._host_ints = [torch.zeros(_INT_FIELDS * mb, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_floats = [torch.zeros(_FLOAT_FIELDS * mb, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._host_tables = [torch.zeros(mb * self.max_blocks, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._host_out = torch.zeros(2, mb, dtype=torch.int64, pin_memory=pin)
        self._np_ints = [t.numpy() for t in self._host_ints]
        self._np_floats = [t.numpy() for t in self._host_floats]
        self._np_tables = [t.numpy() for t in self._host_tables]
        self._slot = 0
        # Host mirrors of the slowly changing per-row inputs (see _prepare).
        self._row_owner: list[tuple | None] = [None] * mb
        self._m_ints = np.zeros((_INT_FIELDS - 3, mb), dtype=np.int64)  # top_k, seed
        self._m_floats = np.zeros((_FLOAT_FIELDS, mb), dtype=np.float32)  # temperature, top_p
        self._m_floats[1] = 1.0
        self._m_tables = np.full((mb, self.max_blocks), NULL_BLOCK, dtype=np.int32)
        # Timing events per staging slot, reused (a slot is reused only after its step was read).
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(2)] if pin else []

        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_captures = 0  # graphs captured so far; must not move once serving starts
        self.capture_stats: dict[int, dict[str, float]] = {}  # bucket -> seconds, bytes

    # -- the captured region ----------------------------------------------------------------------
    def _logits(self, host_ids, prev_row, pos, tables) -> torch.Tensor:
        """Input ids, slot mapping and context lengths on the device, then the model: [b, vocab] float."""
        # Rows continuing from the previous step take its sampled token straight from the device.
        # (out_tokens is read here and only written at the end of this same step.)
        ids = torch.where(prev_row >= 0, self.out_tokens[prev_row.clamp(min=0)], host_ids)
        blk = tables.gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1).long()
        meta = AttentionMetadata(
            slot_mapping=blk * self.block_size + pos % self.block_size,
            block_tables=tables,
            context_lens=(pos + 1).to(torch.int32),
        )
        return self.model.compute_logits(self.model(ids, pos, meta))

    def _compiled_logits(self):
        # Inductor fuses the norms, residual adds, rotary, SiLU*mul and the input preparation; dynamic
        # batch so one compile serves every bucket (each bucket's graph then captures the compiled
        # kernels). The attention backend's KV write + kernel stay outside (a graph break per layer).
        import torch._dynamo.config as dynamo_cfg

        # Each graph break resumes in a layer's frame, guarded per layer instance and per batch-size
        # specialisation: the default recompile limit (8) would silently leave deep models eager.
        limit = 4 * self.model.cfg.num_layers + 16
        for knob, value in (("recompile_limit", limit), ("cache_size_limit", limit),
                            ("accumulated_recompile_limit", 8 * limit), ("accumulated_cache_size_limit", 8 * limit)):
            if hasattr(dynamo_cfg, knob):
                setattr(dynamo_cfg, knob, max(getattr(dynamo_cfg, knob), value))
        return torch.compile(self._logits, dynamic=True, fullgraph=False)

    def _forward(self, b: int, width: int, variant: str) -> None:
        """Decode `b` rows from the static buffers into out_tokens[:b]. No host sync anywhere."""
        host_ids, prev_row, pos, top_k, seeds = self.ints[: _INT_FIELDS * b].view(_INT_FIELDS, b)
        temperature, top_p = self.floats[: _FLOAT_FIELDS * b].view(_FLOAT_FIELDS, b)
        logits = self._logits_fn(host_ids, prev_row, pos, self.block_tables[:b, :width])
        if variant == "greedy":
            tokens = logits.argmax(dim=-1)
        else:
            st = SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds)
            tokens = sample(logits, st, pos + 1, use_top_k_top_p=variant == "filtered")
        self.out_tokens[:b].copy_(tokens)

    # -- start-up ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Captures every (bucket, variant), largest bucket first, into one shared memory pool."""
        if not self.use_cuda_graph:
            return
        from tqdm import tqdm

        # All-zero inputs are all padding: prev_row 0 is harmless, every write goes to NULL_BLOCK.
        self.ints.zero_()
        self.floats.zero_()
        self.block_tables.fill_(NULL_BLOCK)
        bar = tqdm(sorted(self.buckets, reverse=True), desc="capturing decode graphs", disable=not progress)
        for b in bar:
            torch.cuda.synchronize()
            # torch.cuda.graph() empties the allocator cache on entry: do it first, so that the
            # difference in reserved memory is what this bucket's graphs added to the shared pool.
            torch.cuda.empty_cache()
            t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved(self.device)
            for v in self.variants:
                self._forward(b, self.max_blocks, v)  # warm-up: lazy init, autotuning, allocator
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._forward(b, self.max_blocks, v)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(b, v)] = g
                self.num_captures += 1
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.capture_stats[b] = {
                "seconds": time.perf_counter() - t0,
                "bytes": torch.cuda.memory_reserved(self.device) - mem0,
            }
            bar.set_postfix(bs=b)

    @property
    def capture_seconds(self) -> float:
        return sum(s["seconds"] for s in self.capture_stats.values())

    @property
    def capture_bytes(self) -> int:
        return int(sum(s["bytes"] for s in self.capture_stats.values()))

    # -- one step ---------------------------------------------------------------------------------
    def padded_size(self, n: int) -> int:
        return bucket_for(self.buckets, n) or n

    def _prepare(self, rows, b: int, slot: int) -> int:
        """Fills host staging slot for a batch padded to b rows; returns the block-table width.

        Per-row state that rarely changes (sampling parameters, block tables) lives in host mirrors
        keyed by which sequence holds the row and how many blocks it had: a row is rewritten only when
        that changes (a sequence joined/left or took a new block), then the mirror is copied into the
        staging slot with one slice per field. Positions and input tokens change every step."""
        n = len(rows)
        ints = self._np_ints[slot][: _INT_FIELDS * b].reshape(_INT_FIELDS, b)
        floats = self._np_floats[slot][: _FLOAT_FIELDS * b].reshape(_FLOAT_FIELDS, b)
        owner, m_ints, m_floats, m_tables = self._row_owner, self._m_ints, self._m_floats, self._m_tables
        width = 1
        for i, r in enumerate(rows):
            seq = r.seq
            table = seq.block_table
            nb = len(table)
            if nb > width:
                width = nb
            old = owner[i]
            # Identity, not equality: a preempted and readmitted sequence gets a new table list.
            if old is None or old[0] is not seq or old[1] is not table or old[2] != nb:
                if old is None or old[0] is not seq:
                    p = seq.params
                    m_ints[0, i] = p.top_k
                    m_ints[1, i] = seq.seed
                    m_floats[0, i] = p.temperature
                    m_floats[1, i] = p.top_p
                    m_tables[i, nb:] = NULL_BLOCK
                m_tables[i, :nb] = table
                owner[i] = (seq, table, nb)
        for i in range(n, b):  # padding rows: greedy, position 0 of NULL_BLOCK
            if owner[i] is not None:
                m_ints[:, i] = 0
                m_floats[0, i] = 0.0
                m_floats[1, i] = 1.0
                m_tables[i, :] = NULL_BLOCK
                owner[i] = None
        if width > self.max_blocks:
            raise ValueError(f"a sequence holds {width} blocks, more than max_blocks_per_seq={self.max_blocks}")
        ints[0, :n] = [r.token_id for r in rows]
        ints[1, :n] = [r.prev_row for r in rows]
        ints[2, :n] = [r.position for r in rows]
        ints[0, n:] = 0
        ints[1, n:] = -1
        ints[2, n:] = 0
        ints[3:, :] = m_ints[:, :b]
        floats[:, :] = m_floats[:, :b]
        self._np_tables[slot][: b * width].reshape(b, width)[:] = m_tables[:b, :width]
        return width

    @torch.inference_mode()
    def launch(self, rows, variant: str | None = None) -> StepHandle:
        """Enqueues one decode step for `rows` (scheduler.DecodeRow) and returns at once on CUDA."""
        t0 = time.perf_counter()
        n = len(rows)
        assert 0 < n <= self.max_bs, f"batch of {n} rows, max_num_seqs={self.max_bs}"
        variant = variant or choose_variant([r.seq.params for r in rows], self.variants)
        b = self.padded_size(n)
        slot = self._slot
        self._slot ^= 1
        width = self._prepare(rows, b, slot)
        graph = self.graphs.get((b, variant)) if self.use_cuda_graph else None
        cuda = self.device.type == "cuda"
        start_ev = end_ev = None
        if cuda:
            start_ev, end_ev = self._events[slot]
            start_ev.record()
        self.ints[: _INT_FIELDS * b].copy_(self._host_ints[slot][: _INT_FIELDS * b], non_blocking=True)
        self.floats[: _FLOAT_FIELDS * b].copy_(self._host_floats[slot][: _FLOAT_FIELDS * b], non_blocking=True)
        self.block_tables[:b, :width].copy_(self._host_tables[slot][: b * width].view(b, width), non_blocking=True)
        info = StepInfo(n, b, graph is not None, time.perf_counter() - t0, variant)
        t_launch = time.perf_counter()
        if graph is not None:
            # NOTE: columns >= width of the static block tables may hold stale ids from earlier steps.
            # They are valid block ids, and every kernel masks positions >= context length.
            graph.replay()
        else:
            self._forward(b, width, variant)
        info.launch_s = time.perf_counter() - t_launch
        self._host_out[slot, :n].copy_(self.out_tokens[:n], non_blocking=True)
        if cuda:
            end_ev.record()
        handle = StepHandle(self, slot, info, start_ev, end_ev, t0)
        if not cuda:
            handle.gpu_time_s = time.perf_counter() - t0  # the CPU ran the step synchronously
        return handle
