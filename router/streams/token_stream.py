"""TokenStreamReceiver: one gateway process's end of the decode workers' token stream.

Each decode worker PUSHes to this gateway's PULL socket a `StreamBatch` holding only the deltas of
the requests this gateway holds (their `reply_to` is `address`), already detokenized. The receiver
runs on the gateway's event loop; per frame it checks the MAC under the cluster's secret
(cluster/wire/frame_auth.py: a frame from anyone else is dropped and counted), does one msgspec decode
(typed, no dict per row) and
appends each delta to its request's `TokenMailbox`, waking the request's reader if it waits. Deltas of
requests nobody waits for (finished, aborted, or a dead worker's late frames) are dropped. A prefill
worker PUSHes a prompt's first token here too (prefill_worker/first_token_sender.py), which the decode
worker sends again: the mailbox keeps each position of a placement's output once.

No task and no timer per token: a request's "no token for token_timeout_s" deadline is checked by
one watchdog for all requests, which puts an error delta into a mailbox that has waited too long.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio

from cluster.wire.frame_auth import TOKEN_STREAM, FrameVerifier
from cluster.wire.socket_bounds import MAX_TOKEN_FRAME, bound, close_on_collect
from cluster.wire.stream_messages import DeltaLogprobs, StreamDelta, decode_stream_batch
from router.streams.receive_loop import received, verified

log = logging.getLogger(__name__)


class TokenMailbox:
    """The deltas of one request not read yet, and its reader's wake-up."""

    __slots__ = ("pending", "waiter", "last_activity", "_tokens_in")

    def __init__(self, now: float):
        self.pending: list[StreamDelta] = []
        self.waiter: asyncio.Future | None = None
        self.last_activity = now
        self._tokens_in: dict[str, int] = {}  # per placement: the output tokens taken so far

    def put(self, delta: StreamDelta, now: float) -> None:
        if delta.token_ids and delta.start >= 0:
            # A placement's first token comes twice, from its prefill worker and its decode worker,
            # on two sockets in no fixed order (cluster/text/stream_text.py): the copy that comes second
            # is dropped, whole (the same tokens, text, logprobs and finish as the first).
            have = self._tokens_in.get(delta.request_id, 0)
            if delta.start + len(delta.token_ids) <= have:
                return
            self._tokens_in[delta.request_id] = delta.start + len(delta.token_ids)
        self.pending.append(delta)
        self.last_activity = now
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> StreamDelta:
        """Every delta that arrived since the last call, merged into one (up to and including the first
        that ends the request, and only those of the first one's placement): a reader that falls
        behind sends one chunk with several tokens."""
        while not self.pending:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        first = self.pending[0]
        if len(self.pending) == 1 or first.finish_reason is not None or first.error is not None:
            del self.pending[0]
            return first
        tokens, text = [], []
        end = None
        n = 0
        logprobs = None
        for d in self.pending:
            if d.request_id != first.request_id:
                break  # another placement's (a migrated request's mailbox): never merged into this one
            n += 1
            tokens.extend(d.token_ids)
            text.append(d.text)
            if d.logprobs is not None:
                logprobs = d.logprobs if logprobs is None else DeltaLogprobs(
                    logprobs.tokens + d.logprobs.tokens, logprobs.prompt if logprobs.prompt is not None else d.logprobs.prompt)
            if d.finish_reason is not None or d.error is not None:
                end = d
                break
        del self.pending[:n]
        return StreamDelta(first.request_id, tuple(tokens), "".join(text),
                           end.finish_reason if end else None, end.error if end else None, logprobs)


class TokenStreamReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, token_timeout_s: float = 600.0, secret: bytes = b""):
        """secret: the cluster's (cluster/wire/frame_auth.py); a frame without its MAC is dropped and counted
        (`frames_rejected`, and `on_rejected()`, the gateway's metric)."""
        # Bound at construction (before any loop runs): the address goes out in every request.
        self._ctx = zmq.asyncio.Context()
        # Bounded before any MAC is checked (cluster/wire/socket_bounds.py): a frame larger than
        # MAX_TOKEN_FRAME disconnects its sender, and at most RECV_QUEUED frames wait per sender (a
        # decode worker's sends never block: past its own high-water mark it drops, and says so).
        self._sock = bound(self._ctx.socket(zmq.PULL), MAX_TOKEN_FRAME)
        self._sock.setsockopt(zmq.LINGER, 0)
        close_on_collect(self, self._ctx, [self._sock])
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.token_timeout_s = token_timeout_s
        self._mailboxes: dict[str, TokenMailbox] = {}  # worker-side request id -> its mailbox
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches_received = 0
        self._verifier = FrameVerifier(secret, TOKEN_STREAM)
        self.on_rejected: Callable[[], None] = lambda: None

    @property
    def frames_rejected(self) -> int:
        return self._verifier.rejected

    @property
    def open_streams(self) -> int:
        return len(self._mailboxes)

    def register(self, worker_request_id: str) -> TokenMailbox:
        """Must happen before the request is dispatched: its first token may arrive at once."""
        mb = TokenMailbox(self._now())
        self._mailboxes[worker_request_id] = mb
        return mb

    def attach(self, worker_request_id: str, mailbox: TokenMailbox) -> None:
        """Routes a worker-side id to an existing mailbox (a migrated request keeps its client's)."""
        self._mailboxes[worker_request_id] = mailbox

    def unregister(self, worker_request_id: str) -> None:
        self._mailboxes.pop(worker_request_id, None)

    def push(self, delta: StreamDelta) -> None:
        """Delivers a delta that did not come from a decode worker (router errors, drain, timeouts)."""
        mb = self._mailboxes.get(delta.request_id)
        if mb is not None:
            mb.put(delta, self._now())

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    def start(self) -> None:
        if not self._tasks:
            self._loop = asyncio.get_running_loop()
            for mb in self._mailboxes.values():
                mb.last_activity = self._loop.time()
            self._tasks = [self._loop.create_task(self._run(), name="token-stream"),
                           self._loop.create_task(self._watchdog(), name="token-watchdog")]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        boxes = self._mailboxes
        async for batch in received(self._sock, self._read, "token batch"):
            self.batches_received += 1
            now = loop.time()
            for delta in batch.deltas:
                mb = boxes.get(delta.request_id)
                if mb is not None:
                    mb.put(delta, now)

    async def _read(self):
        payload = verified(self._verifier, await self._sock.recv_multipart(copy=False), "token stream frame",
                           self.on_rejected)
        return None if payload is None else decode_stream_batch(payload)

    async def _watchdog(self) -> None:
        """The per-request deadline: a mailbox whose reader has waited `token_timeout_s` without a
        delta gets an error (the request fails instead of hanging on a stuck worker)."""
        timeout = self.token_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = asyncio.get_running_loop().time()
            for rid, mb in list(self._mailboxes.items()):
                if mb.waiter is not None and not mb.pending and now - mb.last_activity > timeout:
                    mb.put(StreamDelta(rid, (), "", "error", f"no token for {timeout:g}s"), now)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self.close()

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
