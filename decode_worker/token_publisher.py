"""TokenPublisher: the decode worker's output side, on its own thread; the decode loop only enqueues.

Per request, registered before it can produce a token: a detokenizer (cluster.text.detokenizer) with the
request's stop strings, and the token sink of the gateway that holds its client (`reply_to`). Per
batch of steps taken off the queue:

- token ids become text; a stop string ends the request here: its delta says finish_reason "stop",
  with the text cut before the stop string, `on_stop(request_id)` tells the loop to drop it (its KV
  blocks go back to the pool), and whatever tokens of it are still in flight are dropped;
- each gateway gets one `StreamBatch` with only its own requests' deltas (one PUSH socket per
  gateway, connected at first use), so K gateway processes each carry 1/K of the stream; every frame
  carries a MAC under the cluster's secret (cluster/wire/frame_auth.py);
- the steps' records go to the router's stats sink in one `StepRecordBatch` (for /stats and the
  step-level Prometheus metrics), once, however many gateways there are.

A request whose prefill worker sent its first token itself (prefill_worker/first_token_sender.py)
gets it again from here, numbered, so that the gateway keeps one copy whichever comes first (cluster/
stream_text.py, the rule both sides share).

Requests without a `reply_to` (in-process use, tests) are kept for `drain()`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

from cluster.wire.frame_auth import STATS_SINK, TOKEN_STREAM, FrameSigner
from cluster.wire.messages import GenerateRequest, TokenBatch, TokenDelta
from cluster.text.stream_text import StreamText, TokenStrings

log = logging.getLogger(__name__)

_STOP = object()
_HALT = object()  # fault "restart": what came before goes out, nothing after
_SEND_HWM = 100_000  # frames queued per gateway before its frames are dropped (it is gone or stuck)


class TokenPublisher:
    def __init__(self, worker_id: str, tokenizer, stats_sink: str | None = None,
                 on_stop: Callable[[str], None] | None = None, keep_local: int = 100_000, secret: bytes = b""):
        """secret: the cluster's (cluster/wire/frame_auth.py): every frame carries a MAC under it."""
        self.worker_id = worker_id
        self.tokenizer = tokenizer
        self.stats_sink = stats_sink
        self._secret = secret
        self.on_stop = on_stop
        self._requests: dict[str, StreamText] = {}  # written by callers' threads, read by the publisher's
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._local: deque = deque(maxlen=keep_local)
        self._local_cv = threading.Condition()
        self._strings = TokenStrings(tokenizer)  # id -> its string in logprobs (publisher thread only)
        self.sent = 0  # frames sent to gateways
        self.dropped = 0  # frames a gateway could not take (gone)
        self._halted = False  # halt(): nothing more is published
        self._thread = threading.Thread(target=self._run, name="decode-token-publisher", daemon=True)
        self._thread.start()

    # -- callers' threads -------------------------------------------------------------------------
    def register(self, req: GenerateRequest) -> None:
        """Before the request can produce a token (reserve / submit_local)."""
        self._requests[req.request_id] = StreamText(self.tokenizer, req)

    def forget(self, request_id: str) -> None:
        """A registered request that will produce nothing (not placed here after all)."""
        self._requests.pop(request_id, None)

    def publish(self, batch: TokenBatch) -> None:
        if not self._halted:
            self._queue.put(batch)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self) -> None:
        """Ready at construction (PublisherProcess's counterpart starts a process)."""

    def drain(self, timeout: float = 0.0):
        """The StreamBatches of requests without a reply_to so far (waits up to `timeout` for one)."""
        with self._local_cv:
            if not self._local and timeout > 0:
                self._local_cv.wait(timeout)
            out = list(self._local)
            self._local.clear()
            return out

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)

    def halt(self, timeout_s: float = 5.0) -> None:
        """Fault injection ("restart", a crash): every batch published so far is sent (the sockets are
        flushed: handed to the connections to their gateways, see _run's end), then the publisher
        stops; later batches are dropped. Returns once that is done (or after `timeout_s`)."""
        self._halted = True
        self._queue.put(_HALT)
        self._thread.join(timeout_s)

    # -- the publisher's thread -------------------------------------------------------------------
    def _text_delta(self, d: TokenDelta):
        """(reply_to, StreamDelta) for a loop delta, or None when nobody may see it any more (cluster.
        stream_text.StreamText: the text rule the prefill worker's first token follows too)."""
        text = self._requests.get(d.request_id)
        if text is None:
            return None  # ended here already (stop string), or never ours (an abort after the end)
        delta, stopped_here = text.delta(d.request_id, d.token_ids, d.finish_reason, d.error, d.logprobs,
                                         d.prompt_logprobs, self._strings)
        if delta.finish_reason is not None:
            del self._requests[d.request_id]
        if stopped_here and self.on_stop is not None:
            self.on_stop(d.request_id)  # the loop still runs it: drop it there, free its blocks
        return text.reply_to, delta

    def _run(self) -> None:
        # Imported here: the decode benchmarks drive the loop without a publisher and need neither.
        from cluster.wire.stream_messages import StepRecordBatch, StreamBatch, encode

        import zmq

        # This thread's own context: ending it (term) is how we know the frames left (see the end).
        ctx = zmq.Context()
        socks: dict[str, tuple] = {}  # sink -> (socket, its signer)
        stats_sock = None
        stats_signer = FrameSigner(self._secret, STATS_SINK)
        halt = False
        try:
            while True:
                items = [self._queue.get()]
                while True:  # everything already queued goes out together (a behind publisher catches up)
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                end = next((i for i, b in enumerate(items) if b is _STOP or b is _HALT), None)
                stop = end is not None
                halt = stop and items[end] is _HALT
                batches = items if end is None else items[:end]
                if batches:
                    now = time.time()
                    by_sink: dict[str | None, list] = {}
                    for b in batches:
                        for d in b.deltas:
                            item = self._text_delta(d)
                            if item is not None:
                                by_sink.setdefault(item[0], []).append(item[1])
                    step = batches[-1].step
                    for sink, deltas in by_sink.items():
                        frame = StreamBatch(self.worker_id, step, tuple(deltas))
                        if sink is None:
                            with self._local_cv:
                                self._local.append(frame)
                                self._local_cv.notify_all()
                        else:
                            self._send(ctx, socks, sink, encode(frame))
                    records = self._step_records(batches, now, time.perf_counter())
                    if records and self.stats_sink is not None:
                        if stats_sock is None:
                            stats_sock = self._connect(ctx, self.stats_sink)
                        self._send_to(stats_sock, self.stats_sink,
                                      stats_signer.sign(encode(StepRecordBatch(tuple(records)))))
                if stop:
                    break
        except Exception:  # noqa: BLE001 - a broken publisher must not kill the worker; gateways time out
            log.exception("token publisher of %s failed", self.worker_id)
            halt = False
        finally:
            # NOTE: closes every socket and ends the context, which returns once the frames queued in
            # ZMQ have been handed to their connections (or, for a gateway that takes nothing, after
            # the linger): halted, the frames of the batches published before halt() are out of this
            # process before halt() returns (the fault "restart" relies on it: DecodeWorker._die).
            # Otherwise each socket keeps its own linger (_connect).
            ctx.destroy(linger=2000 if halt else None)

    @staticmethod
    def _step_records(batches, now: float, sent_at: float) -> list:
        """The steps' records for the stats sink; `sent_at` (perf_counter) is when their tokens went
        out, so each record says how long the publisher held them (its lag behind the loop)."""
        from cluster.wire.stream_messages import DecodeStepRecord

        out = []
        for b in batches:
            if b.batch_size <= 0:
                continue
            lag = max(0.0, sent_at - b.enqueued) if b.enqueued else 0.0
            t = b.timing
            if t is None:
                out.append(DecodeStepRecord(b.worker_id, b.step, now, b.batch_size, b.bucket, b.step_time_s,
                                            publish_lag_s=lag))
            else:
                out.append(DecodeStepRecord(b.worker_id, b.step, now, b.batch_size, b.bucket, b.step_time_s,
                                            t.interval_s, t.prefill_s, t.idle_s, t.gap_s, t.host_s, lag))
        return out

    @staticmethod
    def _connect(ctx, address: str):
        import zmq

        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        sock.connect(address)
        return sock

    def _send(self, ctx, socks: dict, sink: str, frame: bytes) -> None:
        got = socks.get(sink)
        if got is None:
            got = socks[sink] = (self._connect(ctx, sink), FrameSigner(self._secret, TOKEN_STREAM))
        sock, signer = got
        if self._send_to(sock, sink, signer.sign(frame)):
            self.sent += 1

    def _send_to(self, sock, address: str, parts: list[bytes]) -> bool:
        import zmq

        try:
            # NOTE: never blocks: one gateway that went away must not stall every other one.
            sock.send_multipart(parts, zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1st, 2nd, 4th ... drop: log, don't flood
                log.warning("token publisher of %s: %s is not taking frames; %d dropped", self.worker_id,
                            address, self.dropped)
            return False
