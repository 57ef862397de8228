"""BucketedGraphRunner: one decode step = one host-to-device copy of the live batch, replay a CUDA graph.

- Buckets come from a policy ("vllm", "pow2" or explicit sizes). A batch of n rows runs in the
  smallest bucket >= n (cluster.engine.graph_buckets: the one bucket rule, which the router's placement
  reads too, over the buckets this runner reports); rows n..bucket are padding that point at
  NULL_BLOCK (position 0, context length 1, slot 0 of block 0), so their K/V writes land in the
  reserved block and nowhere else.
- One packed int32 buffer per step (cluster.kernels.step_layout.DecodeStepLayout): sampling
  parameters, input ids, previous-row indices, positions and the block tables at the step's width,
  back to back. The host fills a pinned staging copy and sends it with one non-blocking copy; inside
  the graph `decode_inputs` (one kernel) unpacks it into the static model inputs.
- Persistent rows (vLLM v1's persistent batch): host mirrors keep each row's sampling parameters and
  block table; a row is rewritten only when another sequence takes it or its table grows.
- Input ids come from the device: a row continuing from the previous step reads that step's sampled
  token (`out_tokens[prev_row]`) inside the graph, so the host never needs the token to launch.
- Sampling runs inside the graph: the same kernels cover greedy, temperature, top-k/top-p/min-p rows
  alike (cluster.sampling.sampler). Two variants of the step: "plain" (the default path, exactly the draw),
  captured at every bucket, and "features" (logits processing from per-sequence state, the draw, the
  state update, logprobs: `cluster.sampling.sampler.sample_step`), replayed only when some row's sequence needs
  it and captured at the coarser `feature_bucket_sizes` (a features batch pads to those). Its static
  state and outputs (`features_state_bytes`, ~8 * max_num_seqs * V bytes) are allocated with the
  runner; the KV pool sizing counts them (cluster.kv.kv_cache.kv_pool_blocks).
- Sampling-state slots (cluster.sampling.sampling_state): a sequence that needs features gets a slot when it
  first appears in a step and keeps it while it appears in every step; the host writes the slot then
  (outside the graph, on the stream before the step) from the tokens it has. A sequence missing from
  a step has left (finished, aborted, preempted: DecodeScheduler skips a running sequence that can
  still run only for its grammar, below), so its slot is freed; if it comes back (recomputed after
  preemption) it takes a slot again with no token in flight, from its full history.
- Grammar masks (structured output): every graph applies `kernels.apply_token_bitmask` to the logits
  the draw reads (after processing in the features step; logprobs stay the model's), from a static
  [max_num_seqs, ceil(V / 32)] int32 buffer. The host fills the constrained rows' masks (their
  grammars' next-token bitmasks, cluster.structured.fill_bitmasks) into a pinned staging slot while
  the previous step runs, sends the first k rows with the step's other inputs, and names each row's
  mask in the packed buffer (-1: unconstrained, whose programs return after one load). A constrained
  row never has a token in flight (DecodeScheduler), so its mask is always its current one. A
  sequence holding a sampling-state slot keeps it across the steps its grammar makes it skip.
- Graphs are captured largest bucket first into one shared pool at start-up, never while serving.
- Batches above the largest bucket, and everything on CPU, run the same code eagerly, padded the same.
- Host reads sampled tokens asynchronously (StepHandle, decode_worker/step_handle.py): a pinned buffer
  (two slots, so step t+1's copy cannot overwrite step t's unread tokens) filled by a non-blocking
  copy and guarded by a CUDA event.
- Tensor parallelism (`group`): every rank captures the same graphs (the model's all-reduces and the
  LM head's all-gather inside them). On rank 0, `launch` announces each step to the followers (a
  DecodeStep: the packed words it copies, the bucket, the width, the variant, the sampling-state slots
  its new sequences take, the constrained rows' grammar masks) before replaying; a follower's `replay_step` writes the same slots, copies the
  same words and replays the same graph. Every rank samples the same tokens (the logits are gathered
  whole on every rank, the draw is seeded), so step t+1's input ids come from each rank's own
  out_tokens and the followers never read a token.
"""

from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np
import torch

from cluster import kernels
from cluster.attention import AttentionMetadata
from cluster.distributed.step_messages import DecodeStep, SlotInit, pack_ids, unpack_ids
from cluster.engine.graph_buckets import bucket_sizes, feature_bucket_sizes, padded_size
from cluster.kernels.step_layout import DecodeStepLayout
from cluster.kv.kv_blocks import NULL_BLOCK
from cluster.model.llama import LlamaForCausalLM
from cluster.sampling.sampler import SamplingTensors, StepOutputs, features_state_bytes, log_min_p, sample_step
from cluster.sampling.sampling_params import MAX_LOGPROBS
from cluster.sampling.sampling_state import SamplingState
from cluster.engine.sequence import SequenceStatus
from cluster.structured.grammar import bitmask_words
from cluster.structured.request_grammar import fill_bitmasks
from decode_worker.step_handle import HostStepOutputs, StepHandle, StepInfo

_INT32_MAX = 2**31 - 1
VARIANTS = ("plain", "features")  # the captured step's variants (see the module docstring)


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
        keep_graphs: bool = False,  # keep each cudaGraph_t for inspection (kernels_per_step)
        grammar_masks: bool = True,  # the mask kernel in every graph (False: benchmarks' baseline only)
        group=None,  # this rank's TPGroup (rank 0 announces each step to the followers), or None
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = block_size
        self.max_bs = max_num_seqs
        self.max_blocks = max_blocks_per_seq
        self.buckets = bucket_sizes(buckets, max_num_seqs)
        self.feature_buckets = feature_bucket_sizes(self.buckets)
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        self.keep_graphs = keep_graphs
        self.grammar_masks = grammar_masks
        self.group = group if group is not None and group.size > 1 else None
        self._slot_inits: list[SlotInit] | None = None  # rank 0: this step's new slots, for the followers

        dev, mb = self.device, self.max_bs
        words = DecodeStepLayout(mb).words(self.max_blocks)
        # Static device buffers: the graphs read and write exactly these, forever.
        self.packed = torch.zeros(words, dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(mb, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(mb, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(mb, dtype=torch.int64, device=dev)
        self.context_lens = torch.ones(mb, dtype=torch.int32, device=dev)
        self.sample_positions = torch.ones(mb, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((mb, self.max_blocks), NULL_BLOCK, dtype=torch.int32, device=dev)
        self.out_tokens = torch.zeros(mb, dtype=torch.int64, device=dev)
        # The features variant's state and outputs (cluster.sampling.sampling_state: ~4 * max_num_seqs * V bytes each).
        vocab = model.cfg.vocab_size
        self.sampling_state = SamplingState.allocate(mb, vocab, dev)
        self.step_out = StepOutputs.allocate(mb, vocab, dev)
        self.step_out.tokens = self.out_tokens
        self.features_state_bytes = features_state_bytes(mb, vocab)  # counted by the KV pool sizing
        # Grammar masks of the step's constrained rows, compacted: row i's is token_bitmask[grammar_i].
        mask_rows = mb if grammar_masks else 1
        self.token_bitmask = torch.zeros(mask_rows, bitmask_words(vocab), dtype=torch.int32, device=dev)
        # Host staging, two slots (step t+1 is prepared while step t's copy may still be queued).
        pin = self.device.type == "cuda"
        self._host_masks = torch.zeros(2, mask_rows, bitmask_words(vocab), dtype=torch.int32, pin_memory=pin)
        self._host_packed = [torch.zeros(words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._np_packed = [t.numpy() for t in self._host_packed]
        self._host_out = torch.zeros(2, mb, dtype=torch.int64, pin_memory=pin)
        self._host_lp = torch.zeros(2, mb, dtype=torch.float32, pin_memory=pin)
        self._host_top_ids = torch.zeros(2, mb, MAX_LOGPROBS, dtype=torch.int64, pin_memory=pin)
        self._host_top_lp = torch.zeros(2, mb, MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin)
        self._host_step_outputs = HostStepOutputs(self._host_out, self._host_lp.numpy(), self._host_top_ids.numpy(),
                                                  self._host_top_lp.numpy())
        self._slot = 0
        # Persistent rows: host mirrors of each row's slowly changing inputs (see _update_rows).
        self._row_seq: list = [None] * mb
        self._row_table: list = [None] * mb
        self._row_blocks = [0] * mb
        self._live_rows = 0  # rows 0.._live_rows hold a sequence's state; the rest are padding
        self._m_seed = np.zeros(mb, dtype=np.int64)
        self._m_temperature = np.zeros(mb, dtype=np.float32)
        self._m_top_p = np.ones(mb, dtype=np.float32)
        self._m_top_k = np.zeros(mb, dtype=np.int32)
        self._m_log_min_p = np.full(mb, -np.inf, dtype=np.float32)
        self._m_slot = np.full(mb, -1, dtype=np.int32)  # the row's sampling-state slot, -1: none
        self._slot_of: dict[int, tuple] = {}  # id(sequence) -> (sequence, slot), sequences holding one
        self._free_slots = list(range(mb - 1, -1, -1))
        self._m_tables = np.full((mb, self.max_blocks), NULL_BLOCK, dtype=np.int32)
        # Timing events, a ring of four (start, end) pairs, one per launch: a step's interval reads the
        # previous launch's start event, which must not be recorded again before the step is read
        # (steps t and t+1 are in flight while step t-1's start is still needed).
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(4)] if pin else []
        self._launches = 0
        self._prev_start = None  # the previous launch's start: its event on CUDA, its perf_counter() on CPU

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> the plain step
        self.feature_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # feature bucket -> the features step
        self.pool = None
        self.num_captures = 0  # graphs captured so far; must not move once serving starts
        # variant ("plain" | "features") -> bucket -> {"seconds", "bytes"} of its capture
        self.capture_stats: dict[str, dict[int, dict[str, float]]] = {v: {} for v in VARIANTS}

    @classmethod
    def for_worker(cls, wm, cfg, max_model_len: int, capture_progress: bool = True) -> "BucketedGraphRunner":
        """The decode worker's runner over a WorkerModel (cluster/engine/worker_model.py), captured: built the
        same way on every rank of a tensor-parallel worker (their captures' collectives pair up)."""
        runner = cls(wm.model, wm.kv_cache, cfg.block_size, cfg.max_num_seqs,
                     max_blocks_per_seq=wm.spec.blocks_for_tokens(max_model_len), buckets=cfg.graph_buckets,
                     use_cuda_graph=cfg.use_cuda_graph, group=wm.group)
        runner.capture(progress=capture_progress)
        return runner

    # -- the captured region ----------------------------------------------------------------------
    def _forward(self, b: int, width: int, features: bool = False) -> None:
        """Decode `b` rows from the packed buffer into out_tokens[:b] (features: see cluster.sampling.sampler.
        sample_step). No host sync anywhere.

        NOTE: out_tokens is read (previous step's tokens, by decode_inputs) before it is written (this
        step's, by the sampler): the two kernels are ordered on the stream."""
        lay = DecodeStepLayout(b)
        kernels.decode_inputs(self.packed, b, self.out_tokens, self.input_ids, self.positions, self.slot_mapping,
                              self.context_lens, self.sample_positions, self.block_tables, self.block_size)
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b, :width],
                                 context_lens=self.context_lens[:b])
        logits = self.model.compute_logits(self.model(self.input_ids[:b], self.positions[:b], meta))
        p = self.packed
        st = SamplingTensors(
            temperature=p[lay.temperature : lay.temperature + b].view(torch.float32),
            top_k=p[lay.top_k : lay.top_k + b],
            top_p=p[lay.top_p : lay.top_p + b].view(torch.float32),
            seeds=p[lay.seeds : lay.seeds + 2 * b].view(torch.int64),
            log_min_p=p[lay.log_min_p : lay.log_min_p + b].view(torch.float32),
        )
        masks = (p[lay.grammar : lay.grammar + b], self.token_bitmask) if self.grammar_masks else None
        if features:
            sample_step(logits, st, self.sample_positions[:b], p[lay.slot : lay.slot + b], self.sampling_state,
                        self.step_out, bitmask=masks)
        else:
            if masks is not None:
                kernels.apply_token_bitmask(logits, *masks)  # in place: the plain step has no logprobs
            kernels.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, self.sample_positions[:b],
                           out=self.out_tokens[:b], log_min_p=st.log_min_p)

    # -- start-up ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Captures every variant's buckets, largest first, into one shared memory pool."""
        if not self.use_cuda_graph:
            return
        from tqdm import tqdm

        self.block_tables.fill_(NULL_BLOCK)
        todo = [(b, v) for b in sorted(self.buckets, reverse=True) for v in VARIANTS
                if v == "plain" or b in self.feature_buckets]
        bar = tqdm(todo, desc="capturing decode graphs", disable=not progress)
        for b, variant in bar:
            features = variant == "features"
            # Padding rows (greedy, position 0 of NULL_BLOCK, prev_row 0 harmless, no sampling-state
            # slot) at the full table width: the warm-up's and capture's writes all go to NULL_BLOCK.
            lay = DecodeStepLayout(b)
            self.packed.zero_()
            self.packed[lay.width] = self.max_blocks
            self.packed[lay.slot : lay.slot + b] = -1
            self.packed[lay.grammar : lay.grammar + b] = -1
            self.packed[lay.log_min_p : lay.log_min_p + b].view(torch.float32).fill_(float("-inf"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self._forward(b, self.max_blocks, features)  # warm-up: lazy init, Triton compilation, allocator
            torch.cuda.synchronize()
            # torch.cuda.graph() empties the allocator cache on entry: do it here, after the warm-up, so
            # that the growth of reserved memory from here on is what this bucket's graph added to the
            # shared pool. (Measured from before the warm-up and after a second empty_cache, it went
            # negative: the warm-up's frees of tensors a larger bucket left, released after the capture.)
            torch.cuda.empty_cache()
            mem0 = torch.cuda.memory_reserved(self.device)
            g = torch.cuda.CUDAGraph(keep_graph=self.keep_graphs)
            with torch.cuda.graph(g, pool=self.pool):
                self._forward(b, self.max_blocks, features)
            if self.keep_graphs:
                g.instantiate()
            if self.pool is None:
                self.pool = g.pool()
            (self.feature_graphs if features else self.graphs)[b] = g
            self.num_captures += 1
            torch.cuda.synchronize()
            # No empty_cache before this read: the reserved memory only grows from mem0 (the capture's
            # pool allocations; frees stay cached), so `bytes` is >= 0.
            self.capture_stats[variant][b] = {
                "seconds": time.perf_counter() - t0,
                "bytes": torch.cuda.memory_reserved(self.device) - mem0,
            }
            bar.set_postfix(bs=b, variant=variant)
        torch.cuda.empty_cache()  # the blocks the warm-ups freed go back to the device

    @property
    def capture_seconds(self) -> float:
        return sum(s["seconds"] for per in self.capture_stats.values() for s in per.values())

    @property
    def capture_bytes(self) -> int:
        return int(sum(s["bytes"] for per in self.capture_stats.values() for s in per.values()))

    def capture_summary(self) -> dict:
        """What capture cost, per variant (JSON-ready: the bench and the worker's step metrics)."""
        out = {"graphs": self.num_captures, "seconds": self.capture_seconds, "bytes": self.capture_bytes,
               "features_state_bytes": self.features_state_bytes}
        for v, per in self.capture_stats.items():
            out[v] = {"buckets": sorted(per), "graphs": len(per), "seconds": sum(s["seconds"] for s in per.values()),
                      "bytes": int(sum(s["bytes"] for s in per.values())),
                      "per_bucket": {str(b): per[b] for b in sorted(per)}}
        return out

    def kernels_per_step(self, bucket: int, features: bool = False) -> dict[str, int]:
        """Nodes of a bucket's captured graph by type (needs keep_graphs=True)."""
        from decode_worker.graph_nodes import graph_node_counts

        return graph_node_counts((self.feature_graphs if features else self.graphs)[bucket].raw_cuda_graph())

    # -- one step ---------------------------------------------------------------------------------
    def padded_size(self, n: int, features: bool = False) -> int:
        """Rows a batch of n computes (cluster.engine.graph_buckets: the rule the router's placement reads);
        a features batch pads to the features variant's buckets."""
        return padded_size(self.feature_buckets if features else self.buckets, n)

    def _update_rows(self, rows) -> tuple[int, bool, list[int] | None]:
        """Brings the host mirrors up to date for `rows` (sampling-state slots too); returns (table
        width, whether some row needs the features step, the rows under a grammar mask or None).

        Persistent rows: a row's sampling parameters and block table live in host mirrors, rewritten
        only when another sequence takes the row or its table grew; staging (_stage) then copies the
        mirrors with one slice per field. Input ids, previous rows and positions change every step."""
        n = len(rows)
        row_seq, row_table, row_blocks = self._row_seq, self._row_table, self._row_blocks
        m_tables, m_slot = self._m_tables, self._m_slot
        width = 1
        joined = None  # rows whose new occupant needs a sampling-state slot
        constrained = None  # rows under a grammar
        for i, r in enumerate(rows):
            seq = r.seq
            table = seq.block_table
            nb = len(table)
            if nb > width:
                width = nb
            if seq.grammar is not None:
                if constrained is None:
                    constrained = []
                constrained.append(i)
            # Identity, not equality: a preempted and readmitted sequence gets a new table list.
            if seq is not row_seq[i]:
                p = seq.params
                self._m_seed[i] = seq.seed
                self._m_temperature[i] = p.temperature
                self._m_top_p[i] = p.top_p
                self._m_top_k[i] = min(p.top_k, _INT32_MAX)  # any k >= vocabulary means no limit
                self._m_log_min_p[i] = log_min_p(p.min_p)
                m_slot[i] = -1
                if p.needs_features:
                    if joined is None:
                        joined = []
                    joined.append(i)
                m_tables[i, nb:] = NULL_BLOCK
                m_tables[i, :nb] = table
                row_seq[i], row_table[i], row_blocks[i] = seq, table, nb
            elif table is not row_table[i] or nb != row_blocks[i]:
                m_tables[i, nb:] = NULL_BLOCK
                m_tables[i, :nb] = table
                row_table[i], row_blocks[i] = table, nb
        if self._live_rows > n:  # rows that held sequences become padding: greedy, NULL_BLOCK
            lo, hi = n, self._live_rows
            self._m_seed[lo:hi] = 0
            self._m_temperature[lo:hi] = 0.0
            self._m_top_p[lo:hi] = 1.0
            self._m_top_k[lo:hi] = 0
            self._m_log_min_p[lo:hi] = -np.inf
            m_slot[lo:hi] = -1
            m_tables[lo:hi] = NULL_BLOCK
            row_seq[lo:hi] = [None] * (hi - lo)
            row_table[lo:hi] = [None] * (hi - lo)
            row_blocks[lo:hi] = [0] * (hi - lo)
        self._live_rows = n
        if width > self.max_blocks:
            raise ValueError(f"a sequence holds {width} blocks, more than max_blocks_per_seq={self.max_blocks}")
        if joined is not None or self._slot_of:
            self._assign_slots(rows, joined or ())
        # A slot is held exactly by the present sequences that need features (_assign_slots).
        return width, bool(self._slot_of), constrained

    def _stage(self, rows, b: int, slot: int, width: int, constrained: list[int] | None) -> tuple[int, int]:
        """Fills host staging slot `slot` for a batch padded to b rows from the mirrors (rows past
        len(rows) are padding there) and the grammar masks of the `constrained` rows; returns (the
        words to copy, the masks to copy)."""
        n = len(rows)
        m_tables, m_slot = self._m_tables, self._m_slot
        lay = DecodeStepLayout(b)
        buf = self._np_packed[slot]
        buf[lay.seeds : lay.seeds + 2 * b].view(np.int64)[:] = self._m_seed[:b]
        buf[lay.temperature : lay.temperature + b].view(np.float32)[:] = self._m_temperature[:b]
        buf[lay.top_p : lay.top_p + b].view(np.float32)[:] = self._m_top_p[:b]
        buf[lay.top_k : lay.top_k + b] = self._m_top_k[:b]
        buf[lay.log_min_p : lay.log_min_p + b].view(np.float32)[:] = self._m_log_min_p[:b]
        buf[lay.slot : lay.slot + b] = m_slot[:b]
        gbuf = buf[lay.grammar : lay.grammar + b]
        gbuf[:] = -1
        k = 0
        if constrained is not None:
            if not self.grammar_masks:
                raise ValueError("a constrained row in a runner built without grammar masks")
            k = len(constrained)
            gbuf[constrained] = np.arange(k, dtype=np.int32)
            # NOTE: this staging slot's last copy (two steps ago) was read before that step's tokens.
            fill_bitmasks([rows[i].seq.grammar for i in constrained], self._host_masks[slot], range(k))
        ids = buf[lay.host_ids : lay.host_ids + b]
        prev = buf[lay.prev_row : lay.prev_row + b]
        pos = buf[lay.positions : lay.positions + b]
        ids[:n] = [r.token_id for r in rows]
        prev[:n] = [r.prev_row for r in rows]
        pos[:n] = [r.position for r in rows]
        ids[n:] = 0
        prev[n:] = -1
        pos[n:] = 0
        buf[lay.width] = width
        buf[lay.tables : lay.tables + b * width].reshape(b, width)[:] = m_tables[:b, :width]
        return lay.words(width), k

    def _assign_slots(self, rows, joined) -> None:
        """Frees the slots of sequences that left, then gives the rows in `joined` their sequence's slot
        (a new one, written now from the sequence's tokens, if it has none)."""
        m_slot, slot_of = self._m_slot, self._slot_of
        present = {id(rows[i].seq) for i in np.flatnonzero(m_slot[: len(rows)] >= 0)}
        present.update(id(rows[i].seq) for i in joined)
        for key, (seq, _) in list(slot_of.items()):
            # A constrained sequence skips every other step while running: it keeps its slot.
            if key not in present and not (seq.grammar is not None and seq.status is SequenceStatus.RUNNING):
                self._free_slots.append(slot_of.pop(key)[1])
        new = []
        for i in joined:
            seq = rows[i].seq
            held = slot_of.get(id(seq))
            if held is None:
                # NOTE: the slot is written from the host's tokens, so none may be in flight: a sequence
                # joins a step only right after its prefill or KV arrival (DecodeScheduler).
                assert rows[i].prev_row < 0, f"{seq.request_id} took a sampling-state slot with a token in flight"
                held = slot_of[id(seq)] = (seq, self._free_slots.pop())
                new.append(held)
            m_slot[i] = held[1]
        if new:
            self.sampling_state.init_slots([sl for _, sl in new], [q.params for q, _ in new],
                                           [q.prompt_token_ids for q, _ in new],
                                           [q.generated_token_ids for q, _ in new])
            if self._slot_inits is not None:
                self._slot_inits += [SlotInit(sl, q.params, pack_ids(q.prompt_token_ids),
                                              pack_ids(q.generated_token_ids)) for q, sl in new]

    @torch.inference_mode()
    def launch(self, rows) -> StepHandle:
        """Enqueues one decode step for `rows` (scheduler.DecodeRow) and returns at once on CUDA."""
        t0 = time.perf_counter()
        n = len(rows)
        assert 0 < n <= self.max_bs, f"batch of {n} rows, max_num_seqs={self.max_bs}"
        slot = self._slot
        self._slot ^= 1
        cuda = self.device.type == "cuda"
        start_ev = end_ev = None
        if cuda:
            start_ev, end_ev = self._events[self._launches % len(self._events)]
        self._launches += 1
        leader = self.group is not None and self.group.is_leader
        self._slot_inits = [] if leader else None
        width, features, constrained_rows = self._update_rows(rows)  # may queue sampling-state writes
        b = self.padded_size(n, features)
        words, constrained = self._stage(rows, b, slot, width, constrained_rows)
        if leader:  # before our own replay: the followers start theirs at once
            masks = self._host_masks[slot][:constrained].numpy().tobytes() if constrained else b""
            self.group.publish(DecodeStep(self._np_packed[slot][:words].tobytes(), b, width, features,
                                          self._slot_inits, masks, constrained))
            self._slot_inits = None
        t_step = time.perf_counter()
        if cuda:
            start_ev.record()  # the step on the device starts with its input copy
        if self.use_cuda_graph:
            graph = (self.feature_graphs if features else self.graphs).get(b)
        else:
            graph = None
        self.packed[:words].copy_(self._host_packed[slot][:words], non_blocking=True)
        if constrained:
            self.token_bitmask[:constrained].copy_(self._host_masks[slot][:constrained], non_blocking=True)
        info = StepInfo(n, b, graph is not None, features, time.perf_counter() - t0, constrained=constrained)
        t_launch = time.perf_counter()
        if graph is not None:
            # NOTE: columns >= width of the static block tables may hold stale ids from earlier steps.
            # They are valid block ids, and every kernel masks positions >= context length.
            graph.replay()
        else:
            self._forward(b, width, features)
        info.launch_s = time.perf_counter() - t_launch
        self._host_out[slot, :n].copy_(self.out_tokens[:n], non_blocking=True)
        if features:
            out = self.step_out
            self._host_lp[slot, :n].copy_(out.logprob[:n], non_blocking=True)
            self._host_top_ids[slot, :n].copy_(out.top_ids[:n], non_blocking=True)
            self._host_top_lp[slot, :n].copy_(out.top_logprobs[:n], non_blocking=True)
        if cuda:
            end_ev.record()
        handle = StepHandle(self._host_step_outputs, slot, info, start_ev, end_ev, self._prev_start if cuda else None)
        if not cuda:
            handle.gpu_time_s = handle.ran_in_launch_s = time.perf_counter() - t_step  # the CPU ran it synchronously
            if self._prev_start is not None:
                handle.interval_s = t_step - self._prev_start
        self._prev_start = start_ev if cuda else t_step
        return handle

    @torch.inference_mode()
    def replay_step(self, msg: DecodeStep) -> None:
        """A follower: runs the step rank 0 announced, as rank 0 runs it (its tokens stay on the device:
        the next step reads them from out_tokens, as rank 0's does)."""
        if msg.slot_inits:
            self.sampling_state.init_slots([x.slot for x in msg.slot_inits], [x.params for x in msg.slot_inits],
                                           [unpack_ids(x.prompt) for x in msg.slot_inits],
                                           [unpack_ids(x.output) for x in msg.slot_inits])
        words = np.frombuffer(msg.words, dtype=np.int32)
        host = torch.from_numpy(words.copy())
        if self.device.type == "cuda":
            # NOTE: a fresh pinned buffer per step (PyTorch's caching host allocator keeps it until the
            # copy ran): a follower never waits for its steps, so it cannot reuse staging slots as rank 0 does.
            host = host.pin_memory()
        self.packed[: words.size].copy_(host, non_blocking=True)
        if msg.constrained:  # the constrained rows' grammar masks, as rank 0 computed them
            masks = torch.from_numpy(np.frombuffer(msg.masks, dtype=np.int32).copy()).view(msg.constrained, -1)
            if self.device.type == "cuda":
                masks = masks.pin_memory()
            self.token_bitmask[: msg.constrained].copy_(masks, non_blocking=True)
        graph = (self.feature_graphs if msg.features else self.graphs).get(msg.bucket) if self.use_cuda_graph else None
        if graph is not None:
            graph.replay()
        else:
            self._forward(msg.bucket, msg.width, msg.features)
