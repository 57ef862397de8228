"""TokenPublisher on CPU (no sockets: requests without a reply_to are kept for drain()): what text an
error finish carries, and halt() (the fault "restart")."""

from __future__ import annotations

import pytest

from cluster.wire.messages import GenerateRequest, TokenBatch, TokenDelta
from cluster.sampling.sampling_params import SamplingParams
from cluster.text.tokenizer import load_tokenizer
from decode_worker.token_publisher import TokenPublisher


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_tokenizer(demo_model_dir)


def _texts(pub, n_deltas, timeout=5.0):
    out = []
    while len(out) < n_deltas:
        frames = pub.drain(timeout)
        assert frames, f"{len(out)} of {n_deltas} deltas"
        out += [(d.token_ids, d.text, d.finish_reason) for f in frames for d in f.deltas]
    return out


def test_an_error_finish_does_not_flush_held_back_bytes(tokenizer):
    """An incomplete UTF-8 sequence held back at the failure stays unsent: flushed, it would go out as
    U+FFFD and the worker the request moves to would send the real character after it."""
    e_acute = tokenizer("é", add_special_tokens=False).input_ids  # two byte tokens
    assert len(e_acute) == 2
    pub = TokenPublisher("d0", tokenizer)
    try:
        for rid in ("err", "len"):
            pub.register(GenerateRequest(rid, (0, 5, 6), SamplingParams(max_tokens=5), 1, 0.0))
        pub.publish(TokenBatch("d0", 0, (TokenDelta("err", (e_acute[0],)), TokenDelta("len", (e_acute[0],)))))
        pub.publish(TokenBatch("d0", 1, (TokenDelta("err", (), "error", "loop failed"),
                                          TokenDelta("len", (), "length"))))
        got = _texts(pub, 4)
        assert ((), "", "error") in got  # nothing flushed with the error
        assert ((), "\ufffd", "length") in got  # the end of a sequence flushes what it held
    finally:
        pub.close()


def test_halt_sends_what_came_before_and_nothing_after(tokenizer):
    pub = TokenPublisher("d0", tokenizer)
    try:
        pub.register(GenerateRequest("r", (0, 5), SamplingParams(max_tokens=9), 1, 0.0))
        ids = tokenizer(" the sea", add_special_tokens=False).input_ids
        pub.publish(TokenBatch("d0", 0, (TokenDelta("r", (ids[0],)),)))
        pub.halt()
        pub.publish(TokenBatch("d0", 1, (TokenDelta("r", (ids[1],)),)))
        got = _texts(pub, 1)
        assert [t for t, _, _ in got] == [(ids[0],)]
        assert pub.drain(0.3) == []
    finally:
        pub.close()


def test_every_token_is_sent_numbered_by_its_position(tokenizer):
    """Every token goes out, the first one too (its prefill worker may have sent it already: the two
    copies race on two sockets, and the gateway keeps one by `start`, router/streams/token_stream.py); each
    delta says its first token's position in this placement's output, -1 for a delta without tokens."""
    ids = tokenizer(" the sea and the wind", add_special_tokens=False).input_ids
    pub = TokenPublisher("d0", tokenizer)
    try:
        pub.register(GenerateRequest("r", (0, 5), SamplingParams(max_tokens=9), 1, 0.0))
        pub.register(GenerateRequest("one", (0, 5), SamplingParams(max_tokens=1), 1, 0.0))
        pub.publish(TokenBatch("d0", 0, (TokenDelta("r", (ids[0],)), TokenDelta("one", (ids[0],), "length"))))
        pub.publish(TokenBatch("d0", 1, (TokenDelta("r", (ids[1],)),)))
        pub.publish(TokenBatch("d0", 2, (TokenDelta("r", (ids[2],)),)))
        pub.publish(TokenBatch("d0", 3, (TokenDelta("r", (), "length"),)))
        got = []
        while len(got) < 5:
            frames = pub.drain(5.0)
            assert frames, got
            got += [(d.request_id, d.token_ids, d.text, d.finish_reason, d.start) for f in frames for d in f.deltas]
        texts = [tokenizer.decode(ids[:n]) for n in range(4)]
        assert [g for g in got if g[0] == "r"] == [
            ("r", (ids[n],), texts[n + 1][len(texts[n]):], None, n) for n in range(3)] + [("r", (), "", "length", -1)]
        assert [g for g in got if g[0] == "one"] == [("one", (ids[0],), texts[1], "length", 0)]
        assert pub.drain(0.3) == []
    finally:
        pub.close()
