"""Generation.pieces on CPU, with fakes of the router channel and token stream (no sockets): what a
client gets around a worker's failure, and what the migration is told it has (issue 29)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.wire.stream_messages import StreamDelta
from router.stats.metrics import GatewayMetrics
from router.openai.generation import Generation
from router.streams.token_stream import TokenMailbox


class FakeStream:
    def __init__(self):
        self.routes: dict[str, TokenMailbox] = {}

    def attach(self, wrid, mailbox):
        self.routes[wrid] = mailbox

    def unregister(self, wrid):
        self.routes.pop(wrid, None)


class FakeClient:
    def __init__(self, on_migrate):
        self.migrations: list[tuple] = []
        self.finished: list[tuple] = []
        self.on_migrate = on_migrate

    def first_token(self, request_id, t):
        pass

    def finish(self, request_id, abort, first_token_time=None, completion_tokens=0):
        self.finished.append((request_id, abort, completion_tokens))

    async def migrate(self, request_id, wrid, generated, emitted_chars, error):
        self.migrations.append((wrid, generated, emitted_chars))
        return self.on_migrate(wrid)


class FakeGateway:
    def __init__(self, on_migrate=lambda wrid: None):
        self.metrics = GatewayMetrics("m")
        self.client = FakeClient(on_migrate)
        self.token_stream = FakeStream()
        self.ended = []

    def end(self, gen, abort):
        self.ended.append(abort)


def _generation(gw):
    req = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=10), 7, 0.0)
    mb = TokenMailbox(0.0)
    gw.token_stream.attach("r", mb)
    return Generation(gw, req, mb), mb


async def _read(gen):
    return [piece async for piece in gen.pieces()]


def test_text_merged_with_the_failure_counts_before_the_migration_is_asked():
    """The mailbox merges the tokens that arrived with the failure into one delta: their text goes
    out once, before the move, and `emitted_chars` the router is given includes it (it was added only
    after the migration had been asked with the old count: the new worker resent that text)."""
    async def main():
        gw = FakeGateway()
        gen, mb = _generation(gw)
        mb.put(StreamDelta("r", (10,), " a"), 0.0)
        mb.put(StreamDelta("r", (11,), " se"), 0.0)
        mb.put(StreamDelta("r", (), "", "error", "decode worker d0 failed"), 0.0)
        mb.put(StreamDelta("r", (), "", "error", "decode worker d0 died"), 0.0)  # a second notice, old placement
        reader = asyncio.ensure_future(_read(gen))
        while not gw.client.migrations:
            await asyncio.sleep(0)
        assert gw.client.migrations == [("r.m1", (10, 11), 5)]
        mb.put(StreamDelta("r.m1", (12,), " sea", "length"), 0.0)
        pieces = await reader
        assert "".join(t for t, _, _ in pieces) == " a se sea" and pieces[-1][1] == "length"
        assert gw.client.migrations == [("r.m1", (10, 11), 5)]  # the stale second notice moved nothing
        assert gen.emitted_chars == 9 and gen.generated == [10, 11, 12] and gw.ended == [False]
    asyncio.run(main())


@pytest.mark.parametrize("end", [StreamDelta("r", (), "", "error", "boom"),
                                 StreamDelta("r", (), "", "abort")])  # an abort this gateway did not ask for
def test_a_final_failure_still_sends_the_text_read_with_it(end):
    async def main():
        gw = FakeGateway(on_migrate=lambda wrid: ("error", "not moved"))
        gen, mb = _generation(gw)
        mb.put(StreamDelta("r", (10,), " a"), 0.0)
        mb.put(end, 0.0)
        got = []
        try:
            async for text, _, _ in gen.pieces():
                got.append(text)
        except Exception as e:  # noqa: BLE001
            assert type(e).__name__ == "GenerationError" and "not moved" in str(e)
        else:
            raise AssertionError("no error: the stream ended as complete")
        assert got == [" a"] and gw.ended == [True] and gen.finish_reason == "error"
    asyncio.run(main())


def test_an_abort_the_gateway_did_not_ask_for_moves_the_request():
    """The router drops a placement whose prefill failed: it tells the gateway on its channel and the
    decode worker on another, so the worker's end may come first. Read first, an abort once ended the
    stream as complete with no text (CI at 7a9f76f: two streams of
    test_prefill_worker_death_retries_elsewhere were '' with no error event)."""
    async def main():
        gw = FakeGateway()
        gen, mb = _generation(gw)
        mb.put(StreamDelta("r", (), "", "abort"), 0.0)  # the decode worker's end, first
        reader = asyncio.ensure_future(_read(gen))
        while not gw.client.migrations and not reader.done():
            await asyncio.sleep(0)
        assert not reader.done(), f"the stream ended on the abort: {reader.result()}"
        mb.put(StreamDelta("r", (), "", "error", "prefill worker p0 failed"), 0.0)  # the router's notice, late
        mb.put(StreamDelta("r.m1", (12,), " sea", "length"), 0.0)
        pieces = await reader
        assert gw.client.migrations == [("r.m1", (), 0)]
        assert [(t, f) for t, f, _ in pieces] == [(" sea", "length")] and gw.ended == [False]
    asyncio.run(main())


def test_a_mailbox_never_merges_two_placements_deltas():
    async def main():
        mb = TokenMailbox(0.0)
        mb.put(StreamDelta("r.m1", (1,), "a"), 0.0)
        mb.put(StreamDelta("r.m1", (2,), "b"), 0.0)
        mb.put(StreamDelta("r.m2", (3,), "c"), 0.0)
        first = await mb.next()
        assert (first.request_id, first.token_ids, first.text) == ("r.m1", (1, 2), "ab")
        second = await mb.next()
        assert (second.request_id, second.token_ids) == ("r.m2", (3,))
    asyncio.run(main())


# -- held-back text (issue 28: an event per token) --

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


def test_settle_takes_the_notice_of_the_placement_that_produced_the_tokens():
    """PrefillDone may come before the reader asks, after the request ended, or for a placement the
    request left (a migration): `settle` returns as soon as the current placement's came, with its
    cached tokens, and never waits for one that came already."""
    async def main():
        gw = FakeGateway(on_migrate=lambda wrid: None)
        gen, mb = _generation(gw)
        gen.prefill_done("r", 16)  # before any token: kept
        assert gen.settled and gen.cached_tokens == 16
        mb.put(StreamDelta("r", (), "", "error", "decode worker d0 died"), 0.0)
        reader = asyncio.ensure_future(_read(gen))
        await asyncio.sleep(0.01)
        assert gen.worker_request_id == "r.m1" and not gen.settled  # the new placement's notice is due
        gw.token_stream.routes["r.m1"].put(StreamDelta("r.m1", (5,), "x", "length"), 0.0)
        await asyncio.wait_for(reader, 5)
        waiting = asyncio.ensure_future(gen.settle(timeout_s=5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        gen.prefill_done("r.m1", 32)  # after the request ended
        await asyncio.wait_for(waiting, 1)
        assert gen.cached_tokens == 32
        with pytest.raises(StopIteration):  # came already: settle returns without suspending once
            gen.settle(timeout_s=5.0).send(None)
    asyncio.run(main())


def test_first_token_notice_goes_after_its_event_and_the_write_is_stamped_once():
    """The router's FirstToken notice is sent once the reader's task yields (after the event carrying
    the token went out), with the token's own stamp; `wrote_first` stamps the first event written
    after the first token, once."""
    sent = []

    async def run():
        gw = _gateway()
        gw.client.first_token = lambda rid, t: sent.append((rid, t))
        box = TokenMailbox(0.0)
        gen = Generation(gw, GenerateRequest("r", (1, 2), SamplingParams(max_tokens=2), 0, 0.0), box)
        gen.wrote_first()  # nothing came yet: no stamp
        assert gen.first_written_time is None
        box.put(StreamDelta("r", (200,), "a"), 0.0)
        pieces = gen.pieces()
        assert (await pieces.__anext__())[0] == "a"
        assert sent == []  # the event is being written; the notice waits for the loop
        gen.wrote_first()
        written = gen.first_written_time
        gen.wrote_first()
        assert gen.first_written_time == written >= gen.first_token_time
        await asyncio.sleep(0)
        assert sent == [("r", gen.first_token_time)]
        box.put(StreamDelta("r", (201,), "b", "length"), 0.0)
        assert [p async for p in pieces][0][:2] == ("b", "length")
        assert gen.first_written_time == written and len(sent) == 1

    asyncio.run(run())
