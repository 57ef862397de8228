"""Server-sent events and the watchers of a client's connection.

`sse` frames a stream of events as the response; Starlette cancels its iterator when the client
disconnects, and the cancelled `Generation.pieces()` aborts the request. Before a stream starts, and
for a non-streaming request throughout, nothing reads from the connection, so a client that hangs up
would go unnoticed: `unless_gone` (admission and placement, which may wait for room) and
`unless_disconnected` (collecting a whole response) watch for its disconnect and cancel the work,
whose cleanup aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from router.errors import GenerationError
from router.openai.errors import api_error

DONE = "data: [DONE]\n\n"


def event(data: str) -> str:
    return f"data: {data}\n\n"


def sse(chunks: AsyncIterator[str], on_close=None) -> StreamingResponse:
    # Starlette cancels the iterator when the client disconnects; Generation.pieces() then aborts.
    # on_close runs after the response, however it ended (Starlette runs the background task then).
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(on_close) if on_close is not None else None)


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(request: Request, work, on_gone):
    """Awaits `work` (admission and placement, which may wait for a decode worker with room) while
    watching the connection. A client that hangs up meanwhile cancels it (start_generation's cleanup
    tells the router, which cancels the placement, releases the admission ticket and aborts whatever
    a worker took), so a gone client stops counting as waiting at once. Returns None when the client
    went (`on_gone(result)` lets go of a request placed just as it left)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is None:
        on_gone(task.result())
    return None


async def unless_disconnected(request: Request, work) -> Response:
    """Runs a non-streaming request while watching its connection: a client that hangs up cancels
    the work (whose cleanup aborts the request on the workers)."""
    task = asyncio.ensure_future(work)

    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        try:
            result = task.result()
        except GenerationError as e:
            raise api_error(e) from None
        return JSONResponse(result.model_dump())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
