"""benchmarks.sse_connection.SSEConnection, the TTFT load client's connection, against a scripted HTTP
server (asyncio, raw bytes): the first token's event found across reads, keep-alive reuse, and every way
a response can fail named instead of timed."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.sse_connection import SSEConnection


def _event(i: int, text: str = " t", **extra) -> bytes:
    d = {"id": "cmpl-7", "choices": [{"index": 0, "text": text, "finish_reason": None}],
         "usage": {"prompt_tokens": 3, "completion_tokens": i, "total_tokens": 3 + i}, **extra}
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _serve(script):
    """A server answering each request (on any connection) with the next `script` entry: a list of byte
    strings written one by one (with a short pause between; a None among them drops the connection there),
    or None to drop the connection before answering."""
    seen: list[bytes] = []
    answers = iter(script)

    async def handle(reader, writer):
        for answer in answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(await reader.readexactly(length))
            if answer is None:
                writer.close()
                return
            for part in answer:
                if part is None:
                    writer.close()
                    return
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.002)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


def run(coro):
    return asyncio.run(coro)


def test_first_token_across_reads_and_keep_alive_reuse():
    role_only = b'data: {"id":"cmpl-7","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0}}\n\n'
    first = _event(1)
    stream = [OK_HEAD, _chunk(role_only), _chunk(first[:9]), _chunk(first[9:]), _chunk(_event(2) + _event(3)),
              _chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]

    async def main():
        server, url, seen = await _serve([stream, stream])
        conn = SSEConnection(url)
        await conn.connect()
        proto = conn._proto
        a = await conn.stream(conn.request("/v1/completions", {"n": 1}))
        b = await conn.stream(conn.request("/v1/completions", {"n": 2}))
        assert conn._proto is proto  # the same connection served both
        conn.close()
        server.close()
        return a, b, seen

    a, b, seen = run(main())
    for got in (a, b):
        t0, t_first, rid = got
        assert rid == "cmpl-7" and t_first > t0
        assert t_first - t0 >= 0.004  # the first token's second half came two writes after the role-only event
    assert [json.loads(x) for x in seen] == [{"n": 1}, {"n": 2}]


@pytest.mark.parametrize("answer, why", [
    ([b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 27\r\n\r\n",
      b'{"error":{"message":"bad"}}'], 'HTTP 400: b\'{"error":{"message":"bad"}}\''),
    ([OK_HEAD, _chunk(b'data: {"error":{"message":"overloaded"}}\n\n'), b"0\r\n\r\n"], "stream error: 'overloaded'"),
    ([OK_HEAD, _chunk(_event(1)), _chunk(b'data: {"error":{"message":"late"}}\n\n'), b"0\r\n\r\n"],
     "stream error after the first token"),
    ([OK_HEAD, _chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"], "no token chunk"),
    ([OK_HEAD, _chunk(_event(1)), None], "connection closed by the server"),  # dropped mid-stream
    (None, "connection closed by the server"),  # dropped before the answer
])
def test_failures_are_named_and_the_next_request_reconnects(answer, why):
    good = [OK_HEAD, _chunk(_event(1)), b"0\r\n\r\n"]

    async def main():
        server, url, _ = await _serve([answer, good])
        conn = SSEConnection(url, timeout_s=5)
        got = await conn.stream(conn.request("/v1/completions", {}))
        again = await conn.stream(conn.request("/v1/completions", {}))
        conn.close()
        server.close()
        return got, again

    got, again = run(main())
    assert isinstance(got, str) and why in got, got
    # The connection is opened again after a drop, and reused after a failure the server answered in full.
    assert not isinstance(again, str), again


def test_generated_text_that_reads_error_is_not_an_error():
    stream = [OK_HEAD, _chunk(_event(1)), _chunk(_event(2, text='{"error": 1}')), b"0\r\n\r\n"]

    async def main():
        server, url, _ = await _serve([stream])
        conn = SSEConnection(url)
        got = await conn.stream(conn.request("/v1/completions", {}))
        conn.close()
        server.close()
        return got

    got = run(main())
    assert not isinstance(got, str), got


def test_a_server_that_does_not_answer_times_out():
    async def main():
        async def handle(reader, writer):
            await reader.read(1 << 16)
            await asyncio.sleep(5)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        conn = SSEConnection(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout_s=0.2)
        got = await conn.stream(conn.request("/v1/completions", {}))
        conn.close()
        server.close()
        return got

    assert "TimeoutError" in run(main())
