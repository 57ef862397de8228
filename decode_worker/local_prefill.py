"""LocalPrefill: the decode worker's own prefill passes, run between decode steps.

A request submitted to the decode worker itself (DecodeWorker.submit_local) is prefilled here by the
worker's ModelRunner, FCFS in chunks (cluster.engine.chunked_prefill through DecodeScheduler.schedule_prefill).
While requests are decoding a pass is paced (LocalPrefillPacer: about one decode step's cost by the
measured rates, at most `chunk_tokens`, waiting a few steps for more prompts to share its fixed
cost), so a long prompt is spread over several loop iterations; with nothing decoding, the whole
`max_prefill_tokens` budget is used at once.

Two halves, so that the device never idles for the host: `start` (under the worker's lock) queues the
pass and the first-token draws of the prompts it completes, and returns without waiting for the
device; the loop then launches the next decode step, and only then calls `finish`, which waits for
the draws (not for that step) and lets those sequences start decoding. It owns the measured prefill
rate (`meter`, per token: the router plans with it) and what the passes did (`tokens_total`, `log`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from cluster.wire.messages import TokenDelta
from cluster.engine.model_runner import ModelRunner
from cluster.worker.pass_rate import DevicePassTimer, PassRateMeter
from cluster.sampling.sampler import SampledTokens, sample_tokens_async, take_rows
from cluster.engine.sequence import Sequence, SequenceStatus
from decode_worker.local_prefill_pacer import LocalPrefillPacer
from decode_worker.scheduler import DecodeScheduler
from decode_worker.step_interval import StepIntervalClock


@dataclass
class PendingPrefill:
    """A pass `start` queued whose first-token draws `finish` has not read yet."""

    done: list[Sequence]  # the sequences whose prompt the pass completed
    drawn: SampledTokens  # their first tokens, queued on the device


class LocalPrefill:
    def __init__(self, scheduler: DecodeScheduler, runner: ModelRunner, clock: StepIntervalClock,
                 device: torch.device, chunk_tokens: int, lock: threading.RLock):
        """`lock`: the worker's; `start` runs under it, `finish` takes it to hand the sequences over."""
        self.scheduler = scheduler
        self.runner = runner
        self.clock = clock
        self._lock = lock
        # Measured cost the router plans with: local prefill per token.
        self.meter = PassRateMeter()
        self.timer = DevicePassTimer(self.meter, device)
        self.tokens_total = 0
        # (decode steps launched so far, tokens, requests decoding) per pass: what the chunk cap did.
        self.log: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self.chunk_tokens = chunk_tokens
        self.pacer = LocalPrefillPacer(chunk_tokens)

    def reset_counters(self) -> None:
        """What counts serving only (after the warm-up); the measured rate stays."""
        self.tokens_total = 0
        self.log.clear()

    @torch.inference_mode()
    def start(self, step: int, last_step_s: float | None) -> tuple[list[TokenDelta], PendingPrefill | None]:
        """Under the lock: queues a local-prefill pass (paced while requests decode: LocalPrefillPacer,
        by `last_step_s`, the latest decode step's device time) and the first-token draws of the
        prompts it completes; nothing waits for the device. `step`: the decode steps launched so far.
        Returns the deltas of prompts it only scored (no token to draw) and the queued draws."""
        s = self.scheduler
        s.readmit_preempted()
        budget = None  # nothing decoding: the whole max_prefill_tokens, at once
        if s.running:
            budget = self.pacer.budget(self.meter.rate(), last_step_s)
            if not self.pacer.ready(s.prefill_waiting_tokens(), budget, step):
                return [], None
        chunks = s.schedule_prefill(budget)
        if not chunks:
            return [], None
        tokens = sum(len(c.token_ids) for _, c in chunks)
        span = self.clock.prefill_start()  # the pass and its first-token draw, between two steps
        start = self.timer.start()
        logits = self.runner.prefill_sequences(chunks)
        self.timer.stop(start, tokens)
        self.tokens_total += tokens
        self.log.append((step, tokens, len(s.running)))
        done = s.on_prefill_done(chunks)
        scored = []
        for q in [q for q in done if q.params.scores_prompt_only]:  # prompt scoring: no token
            scored.append(s.on_prompt_scored(q, tuple(q.prompt_logprobs or ())))
            done.remove(q)
        drawn = None
        if done:
            rows = [i for i, (q, _) in enumerate(chunks) if q in done]
            # The grammar masks are filled now; each grammar advances with its token in finish().
            drawn = sample_tokens_async(take_rows(logits, rows), [q.params for q in done], [q.seed for q in done],
                                        [q.num_tokens for q in done], [q.prompt_token_ids for q in done],
                                        [q.generated_token_ids for q in done], [q.grammar for q in done])
        self.clock.prefill_end(span)
        return scored, (PendingPrefill(done, drawn) if done else None)

    def finish(self, pending: PendingPrefill) -> list[TokenDelta]:
        """The first tokens of the prompts a pass completed (waits for their draw only), then, under
        the lock, those sequences start decoding. One aborted meanwhile is left out."""
        tokens, logprobs = pending.drawn.result()
        deltas = []
        with self._lock:
            for s, t, lp in zip(pending.done, tokens, logprobs):
                if s.status is not SequenceStatus.WAITING:
                    continue  # aborted between the pass and now (its blocks are back already)
                prompt_lps, s.prompt_logprobs = s.prompt_logprobs, None  # sent with the first token, once
                deltas.append(self.scheduler.on_prefill_token(s, t, lp, tuple(prompt_lps) if prompt_lps is not None
                                                              else None))
        return deltas
