"""PrefillJob: one prompt on the prefill worker (prefill_worker/prefill_worker.py), from submit() until
its transfer is over."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from cluster.kv.block_hash import BlockHash
from cluster.sampling.logprobs import PrefillLogprobs
from cluster.wire.messages import PrefillTask, PrefillTimeline, Reservation
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
    # its first token already sent to its gateway (prefill_worker/late_shipment.py).
    reservation: Reservation | None = None
    parked: bool = False
    first_token: int = -1  # drawn (parked jobs: what the late commit sends)
    first_logprobs: PrefillLogprobs | None = None
    pass_points: tuple = ()  # (forward_done_at, first_token_sent, pass_host_s, pass_device_s, pass_tokens)

    def __post_init__(self):
        if self.reservation is None:
            self.reservation = self.task.reservation

    @property
    def prompt(self):
        return self.task.request.prompt_token_ids

    @property
    def request_id(self) -> str:
        return self.task.request.request_id
