"""The gateway's ASGI middleware: ReceivedStamp (the server's TTFT starts at its stamp)."""

from __future__ import annotations

import asyncio
import time

from router.openai.middleware import RECEIVED, ReceivedStamp


def test_received_stamp_marks_http_requests_when_the_app_gets_them():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], scope.get(RECEIVED)))

    async def run():
        stamp = ReceivedStamp(app)
        before = time.time()
        await stamp({"type": "http", "path": "/v1/completions"}, None, None)
        await stamp({"type": "lifespan"}, None, None)  # not a request: no stamp
        return before, time.time()

    before, after = asyncio.run(run())
    assert [t for t, _ in seen] == ["http", "lifespan"] and seen[1][1] is None
    assert before <= seen[0][1] <= after
