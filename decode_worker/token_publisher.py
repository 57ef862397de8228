"""Ships each step's TokenBatch to the gateway from its own thread: the decode loop only enqueues.

With a sink address, batches go out as msgpack over a ZMQ PUSH socket connected to it (the gateway
binds a PULL socket). Without one (in-process use, tests), they are kept for `drain()`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from cluster.messages import TokenBatch

log = logging.getLogger(__name__)

_STOP = object()


def encode_token_batch(batch: TokenBatch) -> dict:
    """The same dict as `batch.to_wire()`, built without dataclasses.asdict (which deep-copies field
    by field and costs ~10 us per delta: a 256-row step would spend milliseconds in it)."""
    return {
        "worker_id": batch.worker_id,
        "step": batch.step,
        "deltas": [{"request_id": d.request_id, "token_ids": d.token_ids, "finish_reason": d.finish_reason,
                    "error": d.error} for d in batch.deltas],
        "step_time_s": batch.step_time_s,
        "batch_size": batch.batch_size,
        "bucket": batch.bucket,
    }


class TokenPublisher:
    def __init__(self, sink: str | None, keep_local: int = 100_000):
        self.sink = sink
        self._queue: queue.Queue = queue.Queue()
        self._local: deque[TokenBatch] = deque(maxlen=keep_local)
        self._local_cv = threading.Condition()
        self.sent = 0
        self._thread: threading.Thread | None = None
        if sink is not None:
            self._thread = threading.Thread(target=self._run, name="decode-token-publisher", daemon=True)
            self._thread.start()

    def publish(self, batch: TokenBatch) -> None:
        if self.sink is None:
            with self._local_cv:
                self._local.append(batch)
                self._local_cv.notify_all()
        else:
            self._queue.put(batch)

    def drain(self, timeout: float = 0.0) -> list[TokenBatch]:
        """Local mode: the batches published so far (waits up to `timeout` for at least one)."""
        with self._local_cv:
            if not self._local and timeout > 0:
                self._local_cv.wait(timeout)
            out = list(self._local)
            self._local.clear()
            return out

    def _run(self) -> None:
        import msgpack
        import zmq  # imported here: the GPU benchmark host has no pyzmq and never publishes

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.sink)
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                sock.send(msgpack.packb(encode_token_batch(item), use_bin_type=True))
                self.sent += 1
        except Exception:  # noqa: BLE001 - a dead sink must not kill the worker; the gateway will notice
            log.exception("token publisher to %s failed", self.sink)
        finally:
            sock.close()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=5)
