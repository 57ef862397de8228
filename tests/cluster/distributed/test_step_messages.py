"""The step messages rank 0 sends its followers round-trip through msgpack unchanged (typed: a frame
that is not one of them is refused), including the sampling parameters of a sequence taking a slot."""

import msgspec
import pytest

from cluster.distributed.step_messages import (DECODER, ENCODER, Chunk, DecodeStep, EagerDecode, PrefillPass,
                                               PromptLogprobsWant, SlotInit, Stop, pack_ids, unpack_ids)
from cluster.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize("msg", [
    PrefillPass([Chunk(pack_ids([0, 5, 7]), 0, pack_ids([1, 2])), Chunk(pack_ids([9]), 32, pack_ids([3, 4, 5]))],
                [None, PromptLogprobsWant(pack_ids([9, 9]), 3)], False, b"\x81\xa1x\x01"),
    PrefillPass([Chunk(pack_ids([1]), 0, pack_ids([1]))], all_logits=True),
    EagerDecode(pack_ids([3, 4]), pack_ids([10, 11]), [pack_ids([1]), pack_ids([2, 3])]),
    DecodeStep(b"\x00\x01\x02\x03" * 9, 8, 3, True,
               [SlotInit(2, SamplingParams(max_tokens=5, logit_bias={7: 1.5}, bad_words_token_ids=((3, 4),),
                                           presence_penalty=0.5, logprobs=2), pack_ids([0, 1, 2]), pack_ids([9]))]),
    Stop("shutdown"),
])
def test_round_trip(msg):
    assert DECODER.decode(ENCODER.encode(msg)) == msg


def test_ids_round_trip_as_int64():
    assert unpack_ids(pack_ids([0, 2**40, 511])) == [0, 2**40, 511]


def test_a_foreign_frame_is_refused():
    with pytest.raises(msgspec.DecodeError):
        DECODER.decode(msgspec.msgpack.encode({"cmd": "rm -rf"}))
