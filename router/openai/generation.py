"""Generation: one admitted request from the gateway's side, its text pieces out of its mailbox.

The decode worker sends text already detokenized with stop strings applied
(decode_worker/token_publisher.py), so a piece is only read, timed (TTFT, ITL) and handed on. A
worker's failure is recovered here: the router places the request again from the tokens the client
already has (`_recover`), and the pieces go on from the same mailbox. However the reading ends
(finished, failed, cancelled because the client left), its link's `end` lets the request go, which
frees its KV blocks on every worker.

Prefix-cache hits (the usage's `prompt_tokens_details.cached_tokens`) come on another channel than the
tokens: the router's PrefillDone, once per placement whose prompt computation ended (a prefill
worker's answer may reach the router after the decode worker's last token reached us). The notices are
kept by worker-side request id from the request's start on, so one that came before the reader asks is
never lost, and the reply waits only for its own placement's (`settle`), which the router always sends.
A Generation holds no reference to the gateway that made it: it gets the narrow objects it calls
(`GenerationLink`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from cluster.wire.messages import GenerateRequest
from cluster.wire.stream_messages import DeltaLogprobs
from router.channel.client import RouterClient
from router.errors import GenerationError
from router.stats.metrics import GatewayMetrics
from router.stats.request_records import ANSWER_WAIT_S
from router.streams.token_stream import TokenMailbox, TokenStreamReceiver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationLink:
    """What a Generation calls: the metrics it observes, the router channel (first token, migrate),
    the token stream (a migration re-routes the mailbox) and `end(gen, abort)`, which lets the
    request go (the gateway's books, Finish to the router)."""

    metrics: GatewayMetrics
    client: RouterClient
    token_stream: TokenStreamReceiver
    end: Callable[["Generation", bool], None]


class Generation:
    """One admitted request from the gateway's side: text pieces out of its mailbox."""

    def __init__(self, link: GenerationLink, req: GenerateRequest, mailbox: TokenMailbox):
        self.link = link
        self.request_id = req.request_id
        self.worker_request_id = req.request_id  # changes when a worker's death moves the request
        self.arrival = req.arrival_time
        self.mailbox = mailbox
        self.params = req.params
        self.prompt_tokens = len(req.prompt_token_ids)
        self.generated: list[int] = []  # every token id the client got (what a migration resumes from)
        self.emitted_chars = 0  # ... and how many characters of text
        self.migrations = 0
        self.first_token_time: float | None = None
        # The SSE event carrying the first token was handed to the socket (`wrote_first`; a stream only)
        self.first_written_time: float | None = None
        self.finish_reason: str | None = None
        self._prefill_notices: dict[str, int] = {}  # worker request id -> its cached tokens (PrefillDone)
        self._notice = asyncio.Event()  # set when a notice arrives
        self.closing = False  # the gateway itself ends it (drain timeout, stop): an error is final
        self.admitted = False  # the router took it (a refused one is counted as rejected, not here)
        self.prompt_logprobs: tuple | None = None  # from the first delta, when asked (prompt_logprobs)

    def wrote_first(self) -> None:
        """The response's writer handed the event with the request's first token to the socket (the
        first call after the first token came stamps it; /stats' `write` part)."""
        if self.first_written_time is None and self.first_token_time is not None:
            self.first_written_time = time.time()

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def prefill_done(self, worker_request_id: str, cached_tokens: int) -> None:
        """The router's PrefillDone for one of the request's placements (any time, even after the
        request ended: its reply may still be waiting in `settle`)."""
        self._prefill_notices[worker_request_id] = cached_tokens
        self._notice.set()

    @property
    def settled(self) -> bool:
        """The current placement's PrefillDone came: `cached_tokens` is final."""
        return self.worker_request_id in self._prefill_notices

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the placement that produced the tokens found in a prefix cache."""
        return self._prefill_notices.get(self.worker_request_id, 0)

    async def settle(self, timeout_s: float = ANSWER_WAIT_S) -> None:
        """Waits until the current placement's PrefillDone came (at once when it came already). The
        router sends one for every placement whose prompt was computed or failed, so the wait is the
        few milliseconds between a prefill worker's answer and the last token; `timeout_s` bounds it
        only for a router gone meanwhile (its notices with it), and then says so."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.settled:
            self._notice.clear()
            try:
                await asyncio.wait_for(self._notice.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.warning("request %s: no PrefillDone for %s within %gs (the router is gone?): "
                            "cached_tokens reported as 0", self.request_id, self.worker_request_id, timeout_s)
                return

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, DeltaLogprobs | None]]:
        """Yields (new text, finish reason or None, the new tokens' logprobs or None); the last piece
        carries the finish reason. One piece per delta that carries tokens, even when the detokenizer
        held their text back (an incomplete UTF-8 character, a possible stop string): a client that
        counts chunks or times tokens sees every token when it is made, its text arriving later."""
        link, m = self.link, self.link.metrics
        last = None
        abort = True  # unless a worker itself finished the request
        try:
            while True:
                d = await self.mailbox.next()
                if d.request_id != self.worker_request_id:
                    # A placement the request has left (a second failure notice of the worker that
                    # failed it, queued before the move): nothing of it may reach the client.
                    continue
                if d.token_ids:
                    now = time.time()
                    if last is None:
                        m.ttft.observe(now - self.arrival)
                        self.first_token_time = now
                        # Sent once this task yields, after the token's event went to the socket (its
                        # stamp is `now`): the message is no part of the client's TTFT. A Finish sent
                        # before it (a one-token request) makes it a no-op at the router.
                        asyncio.get_running_loop().call_soon(link.client.first_token, self.request_id, now)
                    else:
                        m.itl.observe(now - last)
                    last = now
                    self.generated.extend(d.token_ids)
                text, finish, logprobs, failure = d.text, d.finish_reason, d.logprobs, d.error
                if logprobs is not None and logprobs.prompt is not None and self.prompt_logprobs is None:
                    self.prompt_logprobs = logprobs.prompt  # a migrated request's second copy is ignored
                if finish == "abort":
                    # This gateway never reads an abort it asked for (the request has ended here by
                    # then): the router dropped the placement, and it ends or moves like a failure,
                    # never as a complete stream with the text cut short.
                    finish, failure = "error", failure or "the decode worker dropped the request"
                if finish == "error" or failure is not None:
                    # The tokens and text read together with the failure (the mailbox merges what
                    # arrived meanwhile) go out first, and count in what the client has *before* the
                    # router is asked to move the request: the new worker's detokenizer resumes after
                    # `emitted_chars` (sent after the migration, that text would come twice).
                    if text or (logprobs is not None and logprobs.tokens):
                        self.emitted_chars += len(text)
                        yield text, None, logprobs
                    text, logprobs = "", None
                    if self.closing:  # ended by this gateway: nothing to recover, the router may be gone
                        end = ("error", failure)
                    else:
                        end = await self._recover(failure or "the decode worker failed the request")
                    if end is None:  # placed again: its tokens follow in the same mailbox
                        continue
                    finish, error = end
                    if finish == "error":
                        self.finish_reason = "error"
                        raise GenerationError(error or "the decode worker failed the request")
                if d.token_ids or text or finish is not None or (logprobs is not None and logprobs.tokens):
                    self.emitted_chars += len(text)
                    self.finish_reason = finish
                    yield text, finish, logprobs
                if finish is not None:  # the worker (or the router) finished it: nothing to abort
                    abort = False
                    m.e2e.observe(time.time() - self.arrival)
                    m.generation_tokens.inc(self.completion_tokens)
                    m.finished(finish, self.prompt_tokens, self.completion_tokens)
                    return
        finally:
            # Also on cancellation (the client went away): frees the request's KV blocks everywhere.
            link.end(self, abort)

    async def _recover(self, error: str) -> tuple[str, str | None] | None:
        """A worker failed the request: the router places it again if that worker died (None: go on
        reading the same mailbox), else says how it ends."""
        ts = self.link.token_stream
        ts.unregister(self.worker_request_id)  # nothing more from that placement may reach the client
        self.migrations += 1
        wrid = f"{self.request_id}.m{self.migrations}"
        ts.attach(wrid, self.mailbox)  # before the router places it: its first token may come at once
        end = await self.link.client.migrate(self.request_id, wrid, tuple(self.generated), self.emitted_chars, error)
        if end is None:
            self.worker_request_id = wrid
        else:
            ts.unregister(wrid)
        return end
