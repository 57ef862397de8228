"""Typed messages, one per hop: gateway -> router -> prefill -> decode -> gateway.

Control messages are small frozen dataclasses. They cross Ray actor calls (Ray serialises them) or
the gateway -> router channel (msgspec msgpack, router/channel/messages.py); the token stream's own
messages are in cluster/wire/stream_messages.py. No pickle on a socket of ours. The bulk KV never travels
in a message; it goes through a KVTransport into reserved blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.kv.block_pool import CacheChanges
from cluster.worker.pass_rate import PassRate
from cluster.sampling.logprobs import PrefillLogprobs, TokenLogprobs
from cluster.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """Gateway -> router -> workers: a tokenized request.

    Stop strings travel in `params`: the decode worker's token publisher detokenizes and ends the
    request there when one matches."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # resolved at the gateway so that retries and migrations sample identically
    arrival_time: float  # time.time() at the gateway
    reply_to: str | None = None  # token sink of the gateway holding the client's connection (None: local)
    # After a migration the prompt ends with tokens the request already generated: how many, and how
    # many characters of their text the client already has (the new detokenizer resumes from there).
    resumed_tokens: int = 0
    resumed_chars: int = 0
    # time.time() when the gateway's HTTP app got the request (before routing, the body's parse and
    # validation, tokenization: `arrival_time` is after them); None where no HTTP request came
    received_time: float | None = None

    @property
    def prefill_sends_first_token(self) -> bool:
        """Whether a prefill worker that computes this prompt sends the first token to the gateway
        itself, as soon as it is drawn (its decode worker continues from it, and sends it again: the
        gateway keeps one copy, router/streams/token_stream.py): every request with a gateway whose first
        token is wanted (prefill_worker/first_token_sender.py)."""
        return self.reply_to is not None and not self.params.scores_prompt_only


@dataclass(frozen=True)
class ReserveRequest:
    """Router -> decode worker: hold KV blocks for a prompt about to be prefilled elsewhere."""

    request: GenerateRequest
    prefill_worker_id: str  # whose transfer sequence this reservation joins


@dataclass(frozen=True)
class Reservation:
    """Decode worker -> router: blocks reserved for the prompt (+1 slot for the first decode step).

    `transfer_seq` numbers transfers per (prefill, decode) pair: it names the transfer in the
    claim/cancel compare-and-set that decides who owns the blocks (cluster/transport/control.py).

    Prefix caching: the decode worker may already hold the prompt's first `num_cached_blocks` blocks
    (found in its cache and pinned for the request). The transfer skips them: the prefill worker sends
    its blocks from that offset on, and they land in `block_ids`, which are only the blocks the
    transfer writes (the decode worker's block table is the cached ones, then these).
    """

    request_id: str
    decode_worker_id: str
    block_ids: tuple[int, ...]
    transfer_seq: int
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class PrefillTask:
    """Router -> prefill worker: compute the prompt's KV, sample the first token, ship the KV.

    The router sends it as soon as it picked the pair, before the decode worker answered its
    reservation (None here): the prompt computes meanwhile and its first token goes to the gateway;
    the reservation follows (PrefillWorkerAPI.attach), and the KV ships once both are there."""

    request: GenerateRequest
    reservation: Reservation | None = None


@dataclass(frozen=True)
class KVHeader:
    """What the decode side learns of one transfer (the begin and commit control messages): which
    request, how many tokens, the first token, or that no KV comes (ok=False)."""

    request_id: str
    transfer_seq: int
    num_tokens: int  # prompt tokens whose K/V follow
    first_token: int
    ok: bool = True  # False: the prefill failed or was aborted; no payload follows, free the blocks
    logprobs: PrefillLogprobs | None = None  # the first token's and the prompt's, when the request asks


@dataclass(frozen=True)
class PrefillTimeline:
    """When a prompt passed each point on its prefill worker (prefill worker -> router -> /stats).

    Every point is time.time(), the clock the gateway stamps arrival and first token with and the
    router admission and dispatch with: on one host one clock, so the points of one request order and
    their differences add up to its TTFT (across nodes, as close as the hosts' NTP keeps them)."""

    submitted: float  # the task reached the worker (after the router's dispatch call)
    forward_start: float  # the first pass that computed any of the prompt started (host)
    forward_done: float  # the pass that completed the prompt returned on the host
    first_token_sent: float  # its first token was drawn (device synced) and sent toward its gateway
    kv_committed: float  # the KV commit (with the first token) left for the decode worker
    pass_host_s: float  # the completing pass: host wall time of its forward
    pass_device_s: float  # ... and its device time (CUDA events; on CPU the host time)
    pass_tokens: int  # tokens that pass computed (all its prompts' chunks)


@dataclass(frozen=True)
class PrefillResult:
    """Prefill worker -> router once the decode side has the KV (timings feed /metrics)."""

    request_id: str
    first_token: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    ok: bool = True
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefill worker's cache (not computed)
    timeline: PrefillTimeline | None = None  # None when the prompt never completed a pass


@dataclass(slots=True)
class TokenDelta:
    """Decode loop -> its token publisher (same process): new token ids of one request.

    Not frozen, with slots: one is built per row per step on the decode loop's thread, where a frozen
    dataclass's __init__ (object.__setattr__ per field) cost a third of the output processing."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token, when the request asks
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # with the first token, when asked


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Where the interval between two decode steps went (decode loop -> publisher -> /stats).

    interval = the previous step's duration + prefill + idle + gap, each as the decode loop saw it:
    `interval_s`, this step's start since the previous step's start (on the device's clock on CUDA);
    `prefill_s`, local-prefill passes run between the two (device time); `idle_s`, the loop napping
    with nothing to do (waiting for arrivals); `gap_s`, the rest: the device waiting for the host to
    launch (host work, the GIL); `host_s`, the loop thread's own time between the two launches
    (excluding its waits for the device, its naps and the prefill passes)."""

    interval_s: float
    prefill_s: float = 0.0
    idle_s: float = 0.0
    gap_s: float = 0.0
    host_s: float = 0.0


@dataclass(frozen=True)
class TokenBatch:
    """Decode loop -> its token publisher (same process): every token one step produced, for all
    requests; the publisher turns it into text for each gateway (cluster/wire/stream_messages.py)."""

    worker_id: str
    step: int
    deltas: tuple[TokenDelta, ...]
    step_time_s: float = 0.0
    batch_size: int = 0
    bucket: int = 0  # graph bucket the step replayed (0 = eager)
    timing: StepTiming | None = None  # None for the first step (no interval) and for batches of no step
    enqueued: float = 0.0  # time.perf_counter() when the loop handed it over (the publisher's lag)


@dataclass(frozen=True)
class WorkerStats:
    """Any worker -> router, polled: what admission and placement decide on."""

    worker_id: str
    role: str  # "prefill" | "decode"
    healthy: bool = True
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    waiting: int = 0
    outstanding_prefill_tokens: int = 0
    # Decode only: the batch sizes its step is padded to (the CUDA-graph buckets it captured; the
    # eager path pads the same way) and its batch limit. Placement reads these from the worker
    # itself, never from a policy recomputed elsewhere.
    graph_buckets: tuple[int, ...] = ()
    max_num_seqs: int = 0
    extra: dict = field(default_factory=dict)
    # Measured costs (cluster.worker.pass_rate), None until the worker ran a pass. Prefill worker: its packed
    # prefills, per token. Decode worker: its local prefill chunks, per token (prefill_rate), and its
    # decode steps, per row (decode_rate). The router's prefill cost model and the planner read them.
    prefill_rate: PassRate | None = None
    decode_rate: PassRate | None = None
    # Decode only: most local-prefill tokens it runs between two decode steps while requests decode.
    local_prefill_chunk_tokens: int = 0
    prefill_tokens_total: int = 0  # prompt tokens computed since start (either role)


@dataclass(frozen=True)
class KVCacheEvents:
    """Worker -> router, polled with the stats: how the worker's cached KV blocks changed since the
    router's last look (router.placement.kv_index). `salt` and `block_size` name the address space
    (cluster.kv.block_hash) the router hashes prompts in to match them."""

    worker_id: str
    salt: bytes
    block_size: int
    changes: CacheChanges
