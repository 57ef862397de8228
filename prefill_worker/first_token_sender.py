"""FirstTokenSender: the prefill worker sends each prompt's first token to its gateway as soon as it is
drawn, not after the KV transfer, the decode worker's pick-up and its next step (vLLM's and SGLang's
P/D return it from the prefill side too).

Path (one hop): prefill loop -> ZMQ PUSH -> the request's gateway's token-stream PULL socket
(`GenerateRequest.reply_to`, router/streams/token_stream.py), a `StreamBatch` with a MAC under the cluster's
secret, exactly the frame a decode worker's publisher sends. The alternatives cost more hops: through
the router (prefill -> router -> gateway: two, and a third process's event loop on every first
token), or with the KV commit through the decode worker (prefill -> decode loop -> publisher process ->
gateway: three, after the transfer lands).

What the client sees is the decode side's rule, computed here from the same request: the finish
reason of the Sequence (cluster.engine.sequence: EOS / stop_token_ids, max_tokens, the grammar) and the text
of cluster.text.stream_text.StreamText (stop strings, held-back bytes). Its decode worker sends the same
delta again (same position, `StreamDelta.start` 0) and the gateway keeps the copy that comes first:
the two travel on two sockets in no fixed order. A send that fails (a gateway not taking frames)
fails the prompt instead: the router migrates it from the tokens its client has.

Runs on the prefill loop's thread, before the KV commit (a few tens of microseconds per prompt): the
frame is on its way before the decode worker can produce the second token (usually first at the
gateway, but not by any ordering guarantee). Its connection to a
gateway is opened when a prompt for it is first scheduled (`connect`), before its forward, so the
first frame never waits for a TCP handshake the decode worker's frames no longer need.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from cluster.wire.frame_auth import TOKEN_STREAM, FrameSigner
from cluster.wire.messages import GenerateRequest
from cluster.engine.sequence import Sequence
from cluster.wire.stream_messages import StreamBatch, encode
from cluster.text.stream_text import StreamText, TokenStrings

log = logging.getLogger(__name__)

_SEND_HWM = 100_000  # frames queued per gateway before a send fails (it is gone or stuck)


class FirstTokenSender:
    def __init__(self, worker_id: str, load_tokenizer: Callable[[], object], eos_token_ids: tuple[int, ...],
                 secret: bytes = b""):
        """load_tokenizer: called once, by `load()` (the worker's warm-up) or the first send."""
        self.worker_id = worker_id
        self._load_tokenizer = load_tokenizer
        self.tokenizer = None
        self.eos_token_ids = eos_token_ids
        self._secret = secret
        self._strings: TokenStrings | None = None
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, tuple[zmq.Socket, FrameSigner]] = {}  # gateway sink -> (PUSH, its signer)
        self.sent = 0  # first tokens sent

    def load(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = self._load_tokenizer()
            self._strings = TokenStrings(self.tokenizer)

    def connect(self, requests: list[GenerateRequest]) -> None:
        """Opens the connections to the gateways of the requests whose first token will be sent (the
        loop's thread: ZMQ sockets are not thread-safe), before their forward runs."""
        for req in requests:
            if req.prefill_sends_first_token:
                self._connect(req.reply_to)

    def _connect(self, reply_to: str) -> None:
        if reply_to not in self._socks:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            sock.connect(reply_to)
            self._socks[reply_to] = (sock, FrameSigner(self._secret, TOKEN_STREAM))

    def send_all(self, drawn: list, first: dict[str, int | None], errors: dict[str, str]) -> dict[str, float]:
        """drawn: (request, first token or None, logprobs, grammar) of the prompts a pass completed.
        Sends those with a token whose prefill sends it (GenerateRequest.prefill_sends_first_token);
        one that could not be sent gets None in `first` and its error in `errors` (the caller fails
        it). Returns when each was handed to its socket (time.time())."""
        sent_at = {}
        for req, token, logprobs, grammar in drawn:
            rid = req.request_id
            if token is None or not req.prefill_sends_first_token:
                continue
            # Stamped as it is handed over: the gateway may read it before send() returns here.
            sent_at[rid] = time.time()
            try:
                self.send(req, token, logprobs, grammar)
            except Exception as e:  # noqa: BLE001 - this prompt fails, the others go on
                log.warning("first token of %s not sent to %s: %s", rid, req.reply_to, e)
                first[rid] = None
                errors[rid] = f"its first token could not be sent to its gateway: {type(e).__name__}: {e}"
        return sent_at

    def send(self, req: GenerateRequest, token: int, logprobs, grammar) -> None:
        """Sends the request's first token (with its logprobs, a PrefillLogprobs or None) to its gateway.
        `grammar`: the RequestGrammar it was drawn under (structured output), consumed here. Raises if
        the frame could not be queued (the caller fails the prompt)."""
        self.load()
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params, req.seed, self.eos_token_ids,
                       resumed_tokens=req.resumed_tokens, grammar=grammar)
        finish = seq.append_token(token)  # the decode side's Scheduler.on_arrival applies the same
        first = logprobs.first if logprobs is not None else None
        prompt_lps = logprobs.prompt if logprobs is not None else None
        delta, _ = StreamText(self.tokenizer, req).delta(req.request_id, (token,), finish, seq.error,
                                                         None if first is None else (first,), prompt_lps, self._strings)
        self._connect(req.reply_to)
        sock, signer = self._socks[req.reply_to]
        # NOTE: never blocks the loop: a gateway that is gone or stuck fails this prompt instead.
        sock.send_multipart(signer.sign(encode(StreamBatch(self.worker_id, -1, (delta,)))), zmq.NOBLOCK)
        self.sent += 1

    def close(self) -> None:
        for sock, _ in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
