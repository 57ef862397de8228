"""The messages rank 0 of a tensor-parallel worker sends its followers: one per forward pass, before it
runs its own, so every rank runs the same passes with the same inputs in the same order (their
collectives then pair up). msgspec Structs on msgpack (no pickle); arrays travel as raw little-endian
bytes.

  PrefillPass   ModelRunner.prefill / prefill_with_prompt_logprobs (engine, prefill worker, a decode
                worker's local prefill and warm-up): the packed chunks, and what the prompt logprobs ask
  EagerDecode   ModelRunner.decode (the in-process engine's eager decode step)
  DecodeStep    BucketedGraphRunner.launch (a decode worker's step): the packed step-input words
                (cluster/kernels/step_layout.py), the bucket, the table width, which variant, the
                sampling-state slots the step's new sequences take (SlotInit), and the grammar masks
                of its constrained rows (structured output: rank 0's grammars computed them)
  Stop          the worker shuts down: followers leave their loop

Rank 0 samples the first token of a prefill on the host and the followers never need it (it reaches
them as an input id of a later step); inside a decode step every rank samples from the same gathered
logits (cluster/model/parallel_linear.py), so no token travels back.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

from cluster.sampling.sampling_params import SamplingParams


def pack_ids(ids) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def unpack_ids(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i8").tolist()


class Chunk(msgspec.Struct, array_like=True):
    token_ids: bytes  # <i8
    start: int
    block_table: bytes  # <i8


class PromptLogprobsWant(msgspec.Struct, array_like=True):
    prompt: bytes  # <i8
    k: int


class PrefillPass(msgspec.Struct, tag="p"):
    chunks: list[Chunk]
    wants: list[PromptLogprobsWant | None] = []  # empty: none asked (prefill())
    all_logits: bool = False
    shipment: bytes = b""  # the KV this pass ships (cluster/transport/tp_payload.py), msgpack; b"": none


class EagerDecode(msgspec.Struct, tag="e"):
    token_ids: bytes  # <i8
    positions: bytes  # <i8
    block_tables: list[bytes]  # <i8 each


class SlotInit(msgspec.Struct, array_like=True):
    slot: int
    params: SamplingParams
    prompt: bytes  # <i8
    output: bytes  # <i8


class DecodeStep(msgspec.Struct, tag="d"):
    words: bytes  # the packed int32 step inputs, as many words as rank 0 copied
    bucket: int  # rows computed (padded)
    width: int  # block-table width
    features: bool  # the features variant (logits processing, logprobs)
    slot_inits: list[SlotInit] = []
    masks: bytes = b""  # the constrained rows' grammar bitmasks, [constrained, ceil(V / 32)] int32
    constrained: int = 0


class Stop(msgspec.Struct, tag="s"):
    why: str = ""


StepMessage = Union[PrefillPass, EagerDecode, DecodeStep, Stop]
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(StepMessage)
