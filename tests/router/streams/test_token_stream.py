"""TokenMailbox: a placement's first token comes twice (its prefill worker's copy and its decode
worker's, on two sockets in no fixed order) and the reader gets each position once, in order."""

from __future__ import annotations

import asyncio

from cluster.wire.stream_messages import StreamDelta
from router.streams.token_stream import TokenMailbox


def _read_all(box: TokenMailbox) -> list[StreamDelta]:
    async def run():
        out = []
        while box.pending:
            out.append(await box.next())
        return out

    return asyncio.run(run())


def _d(rid, start, tok, text, finish=None):
    return StreamDelta(rid, (tok,), text, finish, None, None, start)


def test_the_prefill_copy_first_then_the_decode_stream():
    box = TokenMailbox(0.0)
    for d in (_d("r", 0, 7, "A"), _d("r", 0, 7, "A"), _d("r", 1, 8, "B"), _d("r", 2, 9, "C", "length")):
        box.put(d, 0.0)
    got = _read_all(box)
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == [((7, 8, 9), "ABC", "length")]


def test_the_decode_stream_overtakes_the_prefill_copy():
    """The race the chaos run found: the decode worker's first two tokens reach the gateway before
    the prefill worker's copy of the first; that late copy must not become a third token."""
    box = TokenMailbox(0.0)
    for d in (_d("r", 0, 7, "A"), _d("r", 1, 8, "B"), _d("r", 0, 7, "A"), _d("r", 2, 9, "C")):
        box.put(d, 0.0)
    got = _read_all(box)
    assert [t for g in got for t in g.token_ids] == [7, 8, 9] and "".join(g.text for g in got) == "ABC"


def test_a_first_token_that_ends_the_request_is_kept_once():
    box = TokenMailbox(0.0)
    box.put(_d("r", 0, 7, "A", "length"), 0.0)
    box.put(_d("r", 0, 7, "A", "length"), 0.0)
    assert [(g.token_ids, g.finish_reason) for g in _read_all(box)] == [((7,), "length")]


def test_positions_are_per_placement_and_deltas_without_tokens_always_pass():
    """After a migration the new placement (`<id>.m1`) numbers its output from 0 again; an error or
    finish without tokens (start -1) is never taken for a copy."""
    box = TokenMailbox(0.0)
    box.put(_d("r", 0, 7, "A"), 0.0)
    box.put(StreamDelta("r", (), "", "error", "worker died"), 0.0)
    box.put(_d("r.m1", 0, 8, "B"), 0.0)
    box.put(_d("r.m1", 0, 8, "B"), 0.0)
    box.put(StreamDelta("r.m1", (), "", "length", None, None, -1), 0.0)
    got = [(g.request_id, g.token_ids, g.finish_reason) for g in _read_all(box)]
    assert got == [("r", (7,), "error"), ("r.m1", (8,), "length")]  # (a placement's deltas merge)
