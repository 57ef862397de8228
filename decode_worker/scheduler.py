"""Continuous batching for the decode worker. No torch, no CUDA state: tested on CPU with fake outputs.

A request's life here:
  reserve()   -> WAITING_FOR_KV (blocks reserved, a transfer will land in them)
  on_arrival  -> RUNNING with the prefill's first token      (or freed, if the transfer failed)
  add_local() -> WAITING (prefilled on this worker, between decode steps; also where preempted
                 requests go to be recomputed)
  decode steps until append_token() says stop, or abort().

Pipelining: the worker launches step t+1 before it reads step t's tokens, so a running sequence can
have one token in flight. Step t+1's input for such a row is step t's output on the device
(`DecodeRow.prev_row`), its position is one past the last confirmed token, and a row whose
max_tokens is already reached by the token in flight is not scheduled at all. Sequences that stop on
EOS/stop tokens are only known to have stopped one step late; their extra row is discarded.

Structured output (seq.grammar): a constrained row's mask for step t+1 depends on the token it
samples in step t, which the host learns only after launching t+1. So a constrained row never runs
with a token in flight: it skips the step launched while its token is on the device and runs in the
next one, mask ready (its grammar advanced when step t's tokens were read, its mask filled while the
step in between runs). It decodes every other step; the rows without a grammar keep the pipeline
(nothing waits for a constrained row's token). Constrained rows go last in a batch, so that the
others keep their rows from step to step (the graph runner's persistent rows). A request whose
grammar is still compiling is not scheduled (neither its local prefill nor its decode rows).
A prompt-scoring request (max_tokens 0) ends at its prefill's end with no token.

Prefix caching: a local prefill (new or a preempted sequence's recompute) starts after the prompt's
cached prefix; blocks are registered in the cache as they fill (arrived prompts, computed chunks,
decode steps that completed).

Blocks are freed only once no step in flight can write them (see BlockManager). When the pool is
short, `schedule_decode` asks the worker to drain the pipeline first (so every deferred free lands),
then preempts the newest sequences, which are recomputed by a local prefill later (vLLM's
"recompute" preemption): a short pool never corrupts KV, it only costs recompute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cluster.engine.chunked_prefill import fcfs_chunks
from cluster.sampling.logprobs import PrefillLogprobs, TokenLogprobs
from cluster.wire.messages import TokenDelta
from cluster.engine.model_runner import PrefillChunk
from cluster.engine.sequence import Sequence, SequenceStatus
from decode_worker.block_manager import BlockManager


@dataclass(slots=True)
class DecodeRow:
    seq: Sequence
    token_id: int  # host-known input token; ignored when prev_row >= 0
    prev_row: int  # row of the step in flight whose sampled token is this row's input, or -1
    position: int  # position of the input token (its K/V goes there; context length = position + 1)


@dataclass
class DecodeBatch:
    step: int
    rows: list[DecodeRow]
    needs_drain: bool = False  # pool short while a step is in flight: drain, then schedule again
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.rows)


class DecodeScheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.waiting_for_kv: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()  # local prefill (new or preempted)
        self.running: list[Sequence] = []
        # request_id -> (step, row) of each of its tokens still on the device, oldest first.
        # (Its last entry is also the last step that includes the request: what its blocks wait for.)
        self._pending: dict[str, deque[tuple[int, int]]] = {}
        self.completed_step = -1  # every step <= this one has finished on the device
        self.num_preemptions = 0

    # -- admission --------------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.waiting_for_kv) + len(self.waiting) + len(self.running)

    def holds(self, request_id: str) -> bool:
        """Whether the request is here, in any state."""
        return (request_id in self.waiting_for_kv or any(x.request_id == request_id for x in self.running)
                or any(x.request_id == request_id for x in self.waiting))

    def sequences(self) -> dict[str, Sequence]:
        """The requests here by id, in any state."""
        return {x.request_id: x for x in (*self.running, *self.waiting, *self.waiting_for_kv.values())}

    def has_room(self) -> bool:
        return self.num_seqs < self.max_num_seqs

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for the prompt plus the first decode slot, its cached prefix taken from the cache
        (seq.num_cached_tokens: the transfer skips those); False if they (or a batch row) don't fit."""
        if not self.has_room() or not self.blocks.allocate_prompt(seq):
            return False
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting_for_kv[seq.request_id] = seq
        return True

    def add_local(self, seq: Sequence) -> bool:
        """Queues a request to prefill here. Blocks are taken now so that it can't be starved later."""
        if not self.has_room() or not self.blocks.allocate_prompt(seq):
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        return True

    def on_arrival(self, request_id: str, first_token: int | None, ok: bool, error: str | None = None,
                   logprobs: PrefillLogprobs | None = None) -> TokenDelta | None:
        """A transfer finished. Returns the delta to publish (first token with the prefill's logprobs,
        or an error), or None if the request was aborted meanwhile (its blocks go back to the pool now)."""
        if self.blocks.release_transfer(request_id):
            return None  # aborted while the transfer was in flight
        seq = self.waiting_for_kv.pop(request_id, None)
        if seq is None:
            return None
        if not ok:
            self.blocks.free_now(seq.block_table)
            seq.block_table = []
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "error"
            return TokenDelta(request_id, (), "error", error or "KV transfer failed")
        landed_from, seq.num_cached_tokens = seq.num_cached_tokens, len(seq.prompt_token_ids)
        self.blocks.cache_computed(seq, landed_from, seq.num_cached_tokens)  # landed: the transport synced it
        seq.status = SequenceStatus.RUNNING
        prompt_lps = logprobs.prompt if logprobs is not None else None
        if seq.params.scores_prompt_only:  # the prefill's token is not wanted
            return self._scored(seq, prompt_lps)
        reason = seq.append_token(first_token)
        if reason is not None:
            self._finish(seq)
        else:
            self.running.append(seq)
        first = logprobs.first if logprobs is not None else None
        return TokenDelta(request_id, (first_token,), reason, seq.error, None if first is None else (first,),
                          prompt_lps)

    def abort(self, request_id: str, transfer_pending: bool) -> bool:
        """Drops a request. transfer_pending: a transport may still write its reserved blocks."""
        seq = self.waiting_for_kv.pop(request_id, None)
        if seq is not None:
            if transfer_pending:
                self.blocks.hold_for_transfer(request_id, seq.block_table)
            else:
                self.blocks.free_now(seq.block_table)
            seq.block_table = []
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            return True
        for queue in (self.waiting, self.running):
            for s in queue:
                if s.request_id == request_id:
                    queue.remove(s)
                    s.finish_reason = "abort"
                    self._finish(s)
                    return True
        return False

    # -- local prefill ----------------------------------------------------------------------------
    def schedule_prefill(self, budget: int | None = None) -> list[tuple[Sequence, PrefillChunk]]:
        """Prefill chunks under the token budget (default max_prefill_tokens), FCFS
        (cluster.engine.chunked_prefill). A preempted sequence still waiting for blocks (readmit_preempted)
        ends the batch: nothing overtakes it."""
        budget = self.max_prefill_tokens if budget is None else min(budget, self.max_prefill_tokens)
        ready = (s for s in self.waiting if s.grammar is None or s.grammar.ready())  # the rest wait for theirs
        return fcfs_chunks(ready, budget,
                           lambda s: (s.all_token_ids, s.num_cached_tokens, s.block_table),
                           lambda s: bool(s.block_table))

    def on_prefill_done(self, chunks: list[tuple[Sequence, PrefillChunk]]) -> list[Sequence]:
        """Advances the chunks' sequences; returns those whose prompt is complete (they need a token)."""
        done = []
        for seq, c in chunks:
            seq.num_cached_tokens += len(c.token_ids)
            self.blocks.cache_computed(seq, c.start, seq.num_cached_tokens)
            if seq.num_cached_tokens == seq.num_tokens:
                done.append(seq)
        return done

    def on_prefill_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None,
                         prompt_logprobs: tuple | None = None) -> TokenDelta:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        reason = seq.append_token(token)
        if reason is not None:
            self._finish(seq)
        else:
            self.running.append(seq)
        return TokenDelta(seq.request_id, (token,), reason, seq.error, None if logprobs is None else (logprobs,),
                          prompt_logprobs)

    def on_prompt_scored(self, seq: Sequence, prompt_logprobs: tuple | None) -> TokenDelta:
        """A prompt-scoring request's prefill is done (no token to sample): it ends here."""
        self.waiting.remove(seq)
        return self._scored(seq, prompt_logprobs)

    def _scored(self, seq: Sequence, prompt_logprobs) -> TokenDelta:
        seq.finish_reason = "length"
        self._finish(seq)
        return TokenDelta(seq.request_id, (), "length", None, None, prompt_logprobs)

    # -- decode -----------------------------------------------------------------------------------
    def _input_of(self, seq: Sequence) -> tuple[int, int, int]:
        """(token_id, prev_row, position) of the sequence's next decode input."""
        pending = self._pending.get(seq.request_id)
        if not pending:
            return seq.last_token_id, -1, seq.num_tokens - 1
        # NOTE: only the latest step's output is on the device, so the token in flight must be from
        # the step just before this one; the worker's loop keeps at most one step unread.
        return 0, pending[-1][1], seq.num_tokens - 1 + len(pending)

    def _schedulable(self, seq: Sequence) -> bool:
        # The token in flight already reaches max_tokens (or the context limit): nothing left to run.
        pending = len(self._pending.get(seq.request_id, ()))
        return (len(seq.output_token_ids) + pending < seq.params.max_tokens
                and seq.num_tokens + pending < self.max_model_len)

    def schedule_decode(self, step: int, pipeline_busy: bool) -> DecodeBatch:
        """The rows of decode step `step`. pipeline_busy: a step is in flight whose results aren't
        processed yet. Grows block tables; on a short pool returns needs_drain or preempts."""
        batch = DecodeBatch(step, [])
        rows = batch.rows
        bsz, max_len, pending_of = self.blocks.block_size, self.max_model_len, self._pending
        # One pass over the running set (this is the per-step host path: keep it flat); the rows whose
        # tables must grow are remembered and grown once the whole need is known to fit.
        grow = []  # (row, extra blocks)
        constrained = []  # rows with a grammar: they go last
        need = 0
        for seq in self.running:
            pending = pending_of.get(seq.request_id)
            n_pending = len(pending) if pending else 0
            n_out = len(seq.output_token_ids)
            n_tokens = len(seq.prompt_token_ids) + n_out
            # The token in flight already reaches max_tokens (or the context limit): nothing to run.
            if n_out + n_pending >= seq.params.max_tokens or n_tokens + n_pending >= max_len:
                continue
            if seq.grammar is not None:
                # NOTE: its mask needs the token in flight (see the module docstring): skip this step.
                if n_pending or not seq.grammar.ready():
                    continue
                pos = n_tokens - 1
                row = DecodeRow(seq, seq.last_token_id, -1, pos)
                constrained.append(row)
            elif n_pending:
                # NOTE: only the latest step's output is on the device, so the token in flight must be
                # from the step just before this one; the worker's loop keeps at most one step unread.
                pos = n_tokens - 1 + n_pending
                row = DecodeRow(seq, 0, pending[-1][1], pos)
                rows.append(row)
            else:
                pos = n_tokens - 1
                row = DecodeRow(seq, seq.last_token_id, -1, pos)
                rows.append(row)
            extra = pos // bsz + 1 - len(seq.block_table)
            if extra > 0:
                need += extra
                grow.append((row, extra))
        if constrained:
            rows += constrained
            grow.sort(key=lambda g: g[0].seq.grammar is not None)  # the rows' order (stable)
        if need > self.blocks.num_free:
            if pipeline_busy:
                batch.rows = []
                batch.needs_drain = True
                return batch
            # Preempt the newest until the rest fit (the engine's policy; recomputed later).
            while rows and need > self.blocks.num_free:
                victim = rows.pop()
                if grow and grow[-1][0] is victim:
                    need -= grow.pop()[1]
                self._preempt(victim.seq)
                batch.preempted.append(victim.seq)
        for r, _ in grow:
            ok = self.blocks.grow(r.seq.block_table, r.position + 1)
            assert ok, "blocks were counted above"
        return batch

    def steps_abandoned(self, last_step: int) -> None:
        """The loop failed with steps up to `last_step` launched; the device is idle now, so they are
        over (their tokens are never read) and the frees that waited for them land."""
        self.completed_step = max(self.completed_step, last_step)
        self._pending.clear()
        self.blocks.step_completed(last_step)

    def on_step_launched(self, batch: DecodeBatch) -> None:
        step, pending_of = batch.step, self._pending
        for i, r in enumerate(batch.rows):
            rid = r.seq.request_id
            pending = pending_of.get(rid)
            if pending is None:
                pending_of[rid] = deque(((step, i),))
            else:
                pending.append((step, i))

    def on_step_output(self, batch: DecodeBatch, tokens: list[int], logprobs=None) -> list[TokenDelta]:
        """Step `batch.step` completed with these sampled tokens (row order), and for a features step
        `logprobs` = (logprob [n], top ids [n, K], top logprobs [n, K]) NumPy arrays. Returns what to
        publish."""
        step = batch.step
        self.completed_step = max(self.completed_step, step)
        pending_of, running = self._pending, SequenceStatus.RUNNING
        bsz = self.blocks.block_size
        deltas = []
        for i, row in enumerate(batch.rows):
            seq = row.seq
            rid = seq.request_id
            pending = pending_of.get(rid)
            if not pending or pending[0][0] != step:
                continue  # finished, aborted or preempted after this step was launched
            pending.popleft()
            if seq.status is not running or seq.finish_reason is not None:
                continue  # finished, aborted or preempted after this step was launched
            tok = tokens[i]
            reason = seq.append_token(tok)
            seq.num_cached_tokens = row.position + 1
            if seq.num_cached_tokens % bsz == 0:  # this step filled a block
                self.blocks.cache_computed(seq, row.position, seq.num_cached_tokens)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq)
            d = TokenDelta(rid, (tok,), reason, seq.error)
            if logprobs is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                lp, ids, top = logprobs  # array-likes (NumPy views from the runner): only this row is converted
                d.logprobs = (TokenLogprobs(float(lp[i]), tuple(ids[i][:k].tolist()), tuple(top[i][:k].tolist())),)
            deltas.append(d)
        self.blocks.step_completed(step)
        return deltas

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        assert not self._pending.get(seq.request_id), "preempt only with the pipeline drained"
        self._release(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # before new local requests; takes blocks again in readmit()
        self.num_preemptions += 1

    def readmit_preempted(self) -> None:
        """Gives blocks back to preempted sequences at the head of the queue, as they fit."""
        for seq in self.waiting:
            if seq.block_table:
                continue
            if not self.blocks.allocate_prompt(seq, count=False):  # its own blocks, if still cached
                break

    def prefill_waiting_tokens(self) -> int:
        """Prompt tokens a local prefill could compute now: of the waiting sequences holding blocks,
        up to the first one that does not (a preempted sequence waiting for blocks ends the queue)."""
        n = 0
        for seq in self.waiting:
            if not seq.block_table:
                break
            n += seq.num_tokens - seq.num_cached_tokens
        return n

    def prefill_ready(self) -> bool:
        return bool(self.waiting) and bool(self.waiting[0].block_table)

    def _release(self, seq: Sequence) -> None:
        pending = self._pending.pop(seq.request_id, None)
        last = pending[-1][0] if pending else -1  # no step in flight includes it: free now
        self.blocks.free_after_step(seq.block_table, last, self.completed_step)
        seq.block_table = []

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self._release(seq)

    def check_blocks(self) -> None:
        """Block accounting: every block reference is held by exactly the requests here (or a deferred
        free); raises AssertionError otherwise (tests, and the worker's `check_blocks`)."""
        self.blocks.check([s.block_table for s in (*self.waiting_for_kv.values(), *self.waiting, *self.running)])

    def has_decode_work(self) -> bool:
        return any(self._schedulable(s) for s in self.running)
