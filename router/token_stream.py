"""TokenStreamReceiver: the gateway's end of the decode workers' token stream.

Each decode worker PUSHes one msgpack `TokenBatch` per step to the address this receiver binds
(ZMQ PULL). The receiver runs on the gateway's asyncio loop and hands each `TokenDelta` to the
asyncio queue of its request; deltas of requests nobody waits for (already finished or aborted)
are dropped. No Ray call per token: one socket message per decode step for all requests.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgpack
import zmq
import zmq.asyncio

from cluster.messages import TokenBatch, TokenDelta

log = logging.getLogger(__name__)


class TokenStreamReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        # Bound at construction (before any loop runs) so the address can be handed to decode
        # workers when they are created; the asyncio side starts with `start()`.
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # never make a decode worker's send block on us
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._task: asyncio.Task | None = None
        self.on_batch: Callable[[TokenBatch], None] | None = None  # step-level metrics hook
        self.batches_received = 0

    def register(self, request_id: str) -> asyncio.Queue[TokenDelta]:
        """Must happen before the request is dispatched: its first token may arrive at once."""
        q: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def attach(self, request_id: str, queue: asyncio.Queue[TokenDelta]) -> None:
        """Routes a worker-side id to an existing queue (a migrated request keeps its client's queue)."""
        self._queues[request_id] = queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def push(self, delta: TokenDelta) -> None:
        """Delivers a delta that did not come from a decode worker (router-side errors)."""
        q = self._queues.get(delta.request_id)
        if q is not None:
            q.put_nowait(delta)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="token-stream")

    async def _run(self) -> None:
        while True:
            try:
                frame = await self._sock.recv()
                batch = TokenBatch.from_wire(msgpack.unpackb(frame, raw=False))
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM or self._sock.closed:
                    return
                log.exception("token stream receive failed")
                continue
            except Exception:  # a malformed frame must not kill the stream of everyone else
                log.exception("dropping a malformed token batch")
                continue
            self.batches_received += 1
            for delta in batch.deltas:
                q = self._queues.get(delta.request_id)
                if q is not None:
                    q.put_nowait(delta)
            if self.on_batch is not None:
                try:
                    self.on_batch(batch)
                except Exception:
                    log.exception("token batch hook failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self.close()

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
