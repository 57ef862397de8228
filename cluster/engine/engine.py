"""LLMEngine: prefill and decode in one process, the reference the disaggregated cluster must match.

Its scheduler is deliberately simple: a step is either one packed prefill (chunked to a token budget)
or one decode step over every running sequence; when the KV pool runs out, the newest sequence is
preempted and recomputed later. With prefix caching (the default) a prompt's leading blocks already in
the cache are taken from it and only the rest is computed, attending to them.

Structured output (params.structured): checked at add_request (a bad schema is an
InvalidRequestError), compiled on the GrammarCompiler's pool; a prompt is prefilled once its grammar
is ready (others go ahead; with nothing else to run the engine waits for it), and every token is
sampled under its grammar's mask (cluster.sampling.sampler.sample_tokens). A prompt-scoring request
(max_tokens 0) ends after its prefill with its prompt logprobs and no token.

With tensor_parallel_size=N > 1 the model is split over N processes (this one is rank 0; the others
are spawned, cluster/distributed/rank_launcher.py) that run every pass it announces (`run_engine_rank`);
call `close()` when done with it.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

import torch

from cluster.kv.block_hash import prefix_cache_salt
from cluster.kv.block_pool import PrefixCachingBlockPool
from cluster.engine.chunked_prefill import fcfs_chunks
from cluster.text.detokenizer import IncrementalDetokenizer
from cluster.distributed.follower import RankFollower
from cluster.distributed.rank_launcher import exit_now
from cluster.distributed.step_messages import EagerDecode, PrefillPass
from cluster.kv.kv_blocks import decode_held_tokens
from cluster.kv.kv_cache import KVCacheSpec, kv_numerics_tag, resolve_kv_cache_dtype
from cluster.model.config import ModelArchConfig
from cluster.model.loader import load_model, resolve_dtype
from cluster.engine.model_runner import ModelRunner, PrefillChunk
from cluster.kv.request_limits import check_request_fits, served_max_model_len
from cluster.sampling.sampler import sample_tokens
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.text.tokenizer import encode_prompt, load_tokenizer
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.worker_model import join_group, lead_group, rank_config, tensor_parallel


def _engine_runner(model_dir: Path, group, *, dtype, device, attention_backend, quantization, kv_cache_dtype,
                   block_size, num_blocks):
    """(model, spec, runner) of one rank of the engine: the same on rank 0 and its followers."""
    arch = ModelArchConfig.from_dir(model_dir)
    model = load_model(model_dir, dtype=dtype, device=device, attention_backend=attention_backend,
                       quantization=quantization, tp=tensor_parallel(group, arch))
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, resolve_dtype(dtype or arch.dtype))
    spec = KVCacheSpec.for_model(arch, block_size, num_blocks, kv_dtype, model.num_kv_heads)
    return model, spec, ModelRunner(model, spec, device, group=group)


def run_engine_rank(rank: int, rendezvous, model_dir: str, options: dict) -> None:
    """A follower rank of a tensor-parallel LLMEngine (a spawned process): runs rank 0's passes."""
    cfg = rank_config(WorkerConfig(str(model_dir), dtype=options["dtype"], device=options["device"]), rank)
    group = join_group(cfg, rank, rendezvous)
    _, _, runner = _engine_runner(Path(model_dir), group, **{**options, "device": cfg.device})
    RankFollower(group, {PrefillPass: runner.execute, EagerDecode: runner.execute}).run()
    group.close()
    exit_now(0)


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple | None = None  # one cluster.sampling.logprobs.TokenLogprobs per token, with params.logprobs
    prompt_logprobs: tuple | None = None  # one per prompt token (the first None), with params.prompt_logprobs
    error: str | None = None  # with finish_reason "error"


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int = 512,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 2048,
        attention_backend: str = "torch",
        enable_prefix_caching: bool = True,
        quantization: str | None = None,  # "fp8": quantize a float checkpoint at load (FP8 checkpoints: None)
        kv_cache_dtype: str = "auto",  # "fp8": an e4m3 KV cache
        tensor_parallel_size: int = 1,  # > 1: the model split over that many processes (this one is rank 0)
    ):
        if model_dir is None:
            from cluster.model.demo import ensure_demo_model

            model_dir = ensure_demo_model()
        self.model_dir = Path(model_dir)
        self.arch = ModelArchConfig.from_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.group = None
        options = dict(dtype=dtype, device=device, attention_backend=attention_backend, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype, block_size=block_size, num_blocks=num_blocks)
        if tensor_parallel_size > 1:
            from cluster.distributed.rank_launcher import ProcessRankLauncher

            self._launcher = ProcessRankLauncher(run_engine_rank, str(self.model_dir), options)
            self.group = lead_group(WorkerConfig(str(self.model_dir), dtype=dtype, device=device,
                                                 tensor_parallel_size=tensor_parallel_size), self._launcher.launch)
        self.model, self.spec, self.runner = _engine_runner(self.model_dir, self.group, **options)
        self.dtype = resolve_dtype(dtype or self.arch.dtype)
        kv_dtype = self.spec.dtype
        numerics = kv_numerics_tag(self.dtype, self.model.quant.tag, kv_dtype)  # FP8 computes other KV
        self.allocator = PrefixCachingBlockPool(num_blocks, block_size,
                                                prefix_cache_salt(self.model_dir, numerics, block_size),
                                                enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = served_max_model_len(None, self.arch.max_position_embeddings)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._rng = random.Random()
        self.grammars = GrammarCompiler(lambda: self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        ids = encode_prompt(self.tokenizer, prompt)
        params.check_token_ids(self.arch.vocab_size)
        check_request_fits(len(ids), params.max_tokens, self.max_model_len, block_size=self.spec.block_size,
                           kv_blocks=self.allocator.capacity, holder="the engine")
        seq = Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            params=params,
            seed=params.seed if params.seed is not None else self._rng.randrange(2**63),
            eos_token_ids=self.arch.eos_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                               skip_special_tokens=params.skip_special_tokens),
        )
        if params.structured is not None:
            self.grammars.check(params.structured)
            seq.grammar = self.grammars.grammar_for(params.structured, seq.request_id)
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Runs one prefill or decode step; returns the sequences that finished in it."""
        failed = self._fail_grammars()
        if failed:
            return failed
        chunks = self._schedule_prefill()
        if chunks:
            return self._run_prefill(chunks)
        if self.running:
            return self._run_decode()
        compiling = next((s for s in self.waiting if s.grammar is not None and not s.grammar.ready()), None)
        if compiling is not None:
            compiling.grammar.wait(timeout=1.0)  # nothing else can run: wait for its grammar
        return []

    def _fail_grammars(self) -> list[Sequence]:
        """Sequences whose grammar failed after admission end with an error."""
        failed = {rid for rid, _ in self.grammars.take_failed()}
        if not failed:
            return []
        out = [s for s in (*self.waiting, *self.running) if s.request_id in failed]
        for seq in out:
            seq.finish_reason, seq.error = "error", seq.grammar.error
            (self.waiting if seq.status is SequenceStatus.WAITING else self.running).remove(seq)
            seq.status = SequenceStatus.FINISHED
            self.allocator.free(seq.block_table)
            seq.block_table = []
        return out

    def _schedule_prefill(self) -> list[tuple[Sequence, PrefillChunk]]:
        planned = 0

        def admit(seq: Sequence) -> bool:
            nonlocal planned
            if len(self.running) + planned >= self.max_num_seqs:
                return False
            if not seq.block_table:
                # Reserve the whole prompt plus the first decode slot up front, so later chunks
                # and the first decode step can't fail for lack of blocks; its cached prefix is
                # not computed again. (A sequence with outputs is a preempted one's recompute.)
                got = self.allocator.allocate_prompt(seq.all_token_ids, decode_held_tokens(seq.num_tokens), seq.block_hashes,
                                                     count=not seq.output_token_ids,
                                                     lookup=seq.params.reads_prefix_cache)
                if got is None:
                    return False
                seq.block_table, seq.num_cached_tokens = got
            planned += 1
            return True

        # Prompt plus tokens kept from before a preemption; a constrained prompt once its grammar is ready.
        ready = (s for s in self.waiting if s.grammar is None or s.grammar.ready())
        return fcfs_chunks(ready, self.max_prefill_tokens,
                           lambda s: (s.all_token_ids, s.num_cached_tokens, s.block_table), admit)

    def _run_prefill(self, chunks) -> list[Sequence]:
        logits = self.runner.prefill_sequences(chunks)
        done_rows, done = [], []
        for i, (seq, c) in enumerate(chunks):
            seq.num_cached_tokens += len(c.token_ids)
            self.allocator.cache_full_blocks(seq.block_table, seq.all_token_ids, seq.block_hashes, c.start,
                                             seq.num_cached_tokens)
            if seq.num_cached_tokens == seq.num_tokens:
                done_rows.append(i)
                done.append(seq)
        if not done:
            return []
        finished = []
        for seq in done:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.params.scores_prompt_only:
                seq.finish_reason = "length"  # no token: its prompt logprobs are the answer
                finished.append(seq)
        sampled = [(i, s) for i, s in zip(done_rows, done) if not s.params.scores_prompt_only]
        if sampled:
            tokens = self._sample(logits[[i for i, _ in sampled]], [s for _, s in sampled])
            finished += [seq for (_, seq), tok in zip(sampled, tokens) if seq.append_token(tok)]
        self._retire(finished)
        return finished

    def _run_decode(self) -> list[Sequence]:
        # Each running sequence writes its last token's K/V at position num_tokens - 1.
        for seq in list(self.running):
            while seq in self.running and len(seq.block_table) * self.spec.block_size < seq.num_tokens:
                if self.allocator.can_allocate(1):
                    seq.block_table += self.allocator.allocate(1)
                else:
                    self._preempt(self.running[-1])
        if not self.running:
            return []
        seqs = list(self.running)
        positions = [s.num_tokens - 1 for s in seqs]
        logits = self.runner.decode([s.last_token_id for s in seqs], positions, [s.block_table for s in seqs])
        tokens = self._sample(logits, seqs)
        finished = [s for s, t in zip(seqs, tokens) if s.append_token(t)]
        for s, pos in zip(seqs, positions):
            s.num_cached_tokens = pos + 1
            self.allocator.cache_full_blocks(s.block_table, s.all_token_ids, s.block_hashes, pos, pos + 1)
        self._retire(finished)
        return finished

    def _sample(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        tokens, logprobs = sample_tokens(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                         [s.num_tokens for s in seqs], [s.prompt_token_ids for s in seqs],
                                         [s.generated_token_ids for s in seqs], [s.grammar for s in seqs])
        for s, lp in zip(seqs, logprobs):
            if lp is not None:
                s.output_logprobs.append(lp)
        return tokens

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks; it is recomputed (prompt + outputs) later."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table, seq.num_cached_tokens = [], 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _retire(self, finished: list[Sequence]) -> None:
        for seq in finished:
            seq.status = SequenceStatus.FINISHED
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
            seq.block_table = []

    def close(self) -> None:
        """Tensor parallelism: stops the follower ranks (nothing to do for one process)."""
        if self.group is not None:
            self.group.close()
            self._launcher.join()
            self.group = None

    # -- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams]) -> list[CompletionOutput]:
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        return [self.output_of(s) for s in seqs]

    @staticmethod
    def output_of(seq: Sequence) -> CompletionOutput:
        text = ""
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
            text = seq.detokenizer.text
        p = seq.params
        return CompletionOutput(seq.request_id, tuple(seq.prompt_token_ids), tuple(seq.output_token_ids), text,
                                seq.finish_reason or "",
                                tuple(seq.output_logprobs) if p.logprobs is not None else None,
                                tuple(seq.prompt_logprobs or ()) if p.prompt_logprobs is not None else None,
                                seq.error)
