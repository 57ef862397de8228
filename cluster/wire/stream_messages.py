"""The token stream's wire messages: decode worker -> gateway (text deltas) and -> router (step records).

msgspec Structs encoded as msgpack arrays (`array_like`): no field names on the wire, decoded straight
into typed objects on the receiving side (one C call per frame, no dict per row), and never pickle.
A decode worker's publisher sends each gateway only the deltas of the requests that gateway holds
(`GenerateRequest.reply_to`), and every step's record to the router's stats sink once.
"""

from __future__ import annotations

import msgspec


class PositionLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One position's logprobs (cluster.sampling.logprobs: the model's raw distribution) with token strings:
    its token's, and the most likely ones'. A token's string is `tokenizer.decode([id])` (as vLLM:
    a piece of a multi-byte character decodes to U+FFFD)."""

    token_id: int
    token: str
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_tokens: tuple[str, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class DeltaLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The logprobs a delta carries: one per token of the delta (empty when not asked), and with a
    request's first delta its prompt's (one per prompt token, the first None), when asked."""

    tokens: tuple[PositionLogprobs, ...] = ()
    prompt: tuple[PositionLogprobs | None, ...] | None = None


class StreamDelta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """New tokens of one request and their text, as the decode worker's detokenizer released it.

    `text` may be empty while tokens arrive (an incomplete UTF-8 character, or a tail that could still
    become a stop string); a stop string ends the request with finish_reason "stop", the text cut
    before it and `token_ids` ending with the token that completed it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: DeltaLogprobs | None = None  # only when the request asks (else one msgpack nil byte)
    # Index of token_ids[0] among this placement's output tokens (-1: not counted, no tokens). Two
    # processes send a placement's first token (its prefill worker, then its decode worker again) on
    # two sockets in no fixed order: the gateway keeps each position once (router/streams/token_stream.py).
    start: int = -1


class StreamBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Decode worker -> one gateway: that gateway's deltas of one or more consecutive steps."""

    worker_id: str
    step: int
    deltas: tuple[StreamDelta, ...]


class DecodeStepRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One decode step as it ran: what load tests join client latencies with (`GET /stats`).

    The interval fields are cluster.wire.messages.StepTiming's (None for a step with no previous one);
    `publish_lag_s` is how long its tokens waited for the publisher thread after the loop handed
    them over (a publisher falling behind delays the client, not the next step)."""

    worker_id: str
    step: int
    t: float  # time.time() when the step's tokens were published
    batch_size: int
    bucket: int  # graph bucket the step replayed (0 = eager)
    step_time_s: float
    interval_s: float | None = None
    prefill_s: float = 0.0
    idle_s: float = 0.0
    gap_s: float = 0.0
    host_s: float = 0.0
    publish_lag_s: float = 0.0


class StepRecordBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Decode worker -> router's stats sink: the step records since the last send."""

    records: tuple[DecodeStepRecord, ...]


encode = msgspec.msgpack.Encoder().encode
decode_stream_batch = msgspec.msgpack.Decoder(StreamBatch).decode
decode_step_records = msgspec.msgpack.Decoder(StepRecordBatch).decode
