"""Generation.pieces on its own (a mailbox and a stand-in gateway): what a stream sends per delta."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cluster.messages import GenerateRequest
from cluster.sampling_params import SamplingParams
from cluster.stream_messages import StreamDelta
from router.openai.generation import Generation
from router.token_stream import TokenMailbox


class _Observed:
    def __init__(self):
        self.values = []

    def observe(self, x):
        self.values.append(x)

    def inc(self, n=1):
        self.values.append(n)


def _gateway():
    m = SimpleNamespace(ttft=_Observed(), itl=_Observed(), e2e=_Observed(), generation_tokens=_Observed(),
                        finished=lambda *a: None)
    ended = []
    return SimpleNamespace(metrics=m, client=SimpleNamespace(first_token=lambda rid, t: None),
                           end=lambda gen, abort: ended.append(abort), ended=ended)


def test_a_token_whose_text_is_held_back_is_still_an_event():
    """The detokenizer may hold a token's text back (an incomplete UTF-8 character): the stream still
    sends an event for it (empty text), so a client that counts chunks or times tokens sees each token
    when it is made; TTFT is the first token's, not the first visible character's."""

    async def run():
        gw = _gateway()
        box = TokenMailbox(0.0)
        req = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=3), 0, 0.0)
        gen = Generation(gw, req, box)
        got = []

        async def read():
            async for piece in gen.pieces():
                got.append(piece)

        task = asyncio.ensure_future(read())
        for d in (StreamDelta("r", (200,), ""), StreamDelta("r", (201,), "é"), StreamDelta("r", (), "", None),
                  StreamDelta("r", (202,), "x", "length")):
            box.put(d, 0.0)
            await asyncio.sleep(0)  # the reader takes each delta on its own
        await asyncio.wait_for(task, 5)
        return gw, gen, got

    gw, gen, got = asyncio.run(run())
    assert [(t, f) for t, f, _ in got] == [("", None), ("é", None), ("x", "length")]  # the empty delta: no event
    assert gen.completion_tokens == 3 and len(gw.metrics.ttft.values) == 1 and len(gw.metrics.itl.values) == 2
    assert gw.ended == [False]
