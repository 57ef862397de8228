"""PrefillJob: one prompt on the prefill worker (prefill_worker/prefill_worker.py), from submit() until
its transfer is over; what is computed from jobs alone: their KV sends, timelines, first tokens."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch
from dataclasses import dataclass, field

from cluster.errors import InvalidRequestError
from cluster.kv.block_hash import BlockHash
from cluster.kv.request_limits import check_request_fits
from cluster.sampling.logprobs import PrefillLogprobs
from cluster.sampling.sampler import SampledTokens, sample_tokens_async, take_rows
from cluster.transport.base import KVSend
from cluster.wire.messages import PrefillResult, PrefillTask, PrefillTimeline, Reservation
from cluster.structured.request_grammar import RequestGrammar


@dataclass
class PrefillJob:
    """A prompt on the prefill worker: its task, its progress through the passes, its blocks."""

    task: PrefillTask
    future: Future
    submitted: float
    started: float = 0.0
    done_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # the prompt's block addresses
    cached_tokens: int = 0  # prompt tokens found in this worker's cache
    aborted: bool = False
    prompt_logprobs: list | None = None  # accumulated over the prompt's chunks, when asked
    grammar: RequestGrammar | None = None  # structured output: its first token obeys it
    # time.time() points for /stats (cluster.wire.messages.PrefillTimeline): arrival here, first pass start
    submitted_at: float = 0.0
    forward_start_at: float = 0.0
    timeline: PrefillTimeline | None = None  # once its first token is drawn and its KV committed
    # Where its KV goes: the task's, or (dispatched before its decode worker reserved) what `attach`
    # brings later. A job whose prompt is computed before that waits `parked`, holding its blocks,
    # its first token already sent to its gateway (PrefillWorker._park, _ship_late).
    reservation: Reservation | None = None
    parked: bool = False
    first_token: int = -1  # drawn (parked jobs: what the late commit sends)
    first_logprobs: PrefillLogprobs | None = None
    # Its last pass: (forward_done_at, first token sent at or None, pass_host_s, pass_device_s, pass_tokens)
    pass_points: tuple = ()

    def __post_init__(self):
        if self.reservation is None:
            self.reservation = self.task.reservation

    @property
    def prompt(self):
        return self.task.request.prompt_token_ids

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    def kv_send(self, reservation: Reservation, block_size: int) -> KVSend:
        """Its KV bound for `reservation`: the blocks its decode worker lacks (that worker may hold
        the prompt's first `num_cached_blocks` already)."""
        k = reservation.num_cached_blocks
        return KVSend(reservation, len(self.prompt) - k * block_size, tuple(self.blocks[k:]))

    def result(self, fut: Future, first_token: int, prefill_done: float, error: str | None) -> PrefillResult:
        """Its answer once its transfer future `fut` resolved (the payload left its blocks, or failed);
        `error`: it failed before (its first token could not be sent, say)."""
        exc = fut.exception()
        if error is None and exc is not None:
            error = f"{type(exc).__name__}: {exc}"
        ok = error is None
        return PrefillResult(self.request_id, first_token, self.started - self.submitted, prefill_done - self.started,
                             time.perf_counter() - prefill_done if ok else 0.0, fut.result().bytes if ok else 0,
                             ok=ok, error=error, cached_tokens=self.cached_tokens, timeline=self.timeline)

    def committed(self, at: float) -> PrefillTimeline:
        """Its timeline, its KV commit having left at `at` (after its last pass: pass_points)."""
        forward_done, sent, host_s, device_s, tokens = self.pass_points
        return PrefillTimeline(self.submitted_at, self.forward_start_at, forward_done, at if sent is None else sent, at,
                               host_s, device_s, tokens)


def reservation_error(reservation: Reservation | None, prompt_tokens: int, block_size: int) -> str | None:
    """The cache-hit rule leaves the last prompt token to compute, so its block is always sent: a
    reservation that skips every block is a bug upstream."""
    if reservation is not None and reservation.num_cached_blocks * block_size >= prompt_tokens:
        return f"reservation skips {reservation.num_cached_blocks} blocks of a {prompt_tokens}-token prompt"
    return None


def failed_result(task: PrefillTask, queue_s: float, error: str) -> PrefillResult:
    return PrefillResult(task.request.request_id, -1, queue_s, 0.0, 0.0, 0, ok=False, error=error)


def check_task(task: PrefillTask, reservation: Reservation | None, *, max_model_len: int, block_size: int,
               kv_blocks: int, vocab_size: int, holder: str) -> None:
    """What a prompt must be for a prefill worker to take it: raises InvalidRequestError or
    CapacityError (cluster.kv.request_limits) otherwise."""
    req = task.request
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("empty prompt", "prompt")
    # Only the prompt's KV is ever held here: max_tokens 0.
    check_request_fits(n, 0, max_model_len, block_size=block_size, kv_blocks=kv_blocks, holder=holder)
    skips = reservation_error(reservation, n, block_size)
    if skips is not None:
        raise InvalidRequestError(skips)
    req.params.check_token_ids(vocab_size)  # they index the sampling kernels' tables


def draw_first_tokens(logits: torch.Tensor, rows: list[int], jobs: list[PrefillJob]) -> SampledTokens:
    """jobs[i]'s first token from logits[rows[i]] (the pass's last-token logits): it sits at position
    len(prompt), the same draw the engine would make, queued on the device with no host sync
    (`SampledTokens.result()` -> the tokens and, per job, its logprobs or None)."""
    reqs = [j.task.request for j in jobs]
    # A migrated request's prompt ends with the tokens it generated before (resumed_tokens): its
    # penalties and bad words count them as generated, as they did on its first placement.
    return sample_tokens_async(take_rows(logits, rows), [r.params for r in reqs], [r.seed for r in reqs],
                               [len(r.prompt_token_ids) for r in reqs], [r.prompt_token_ids for r in reqs],
                               [r.prompt_token_ids[len(r.prompt_token_ids) - r.resumed_tokens:] for r in reqs],
                               grammars=[j.grammar for j in jobs])
