"""AbortNotices: tells decode workers, off the caller's thread, that a transfer they reserved blocks
for carries no KV (the prompt failed, was aborted, or never came), so they free the blocks now
instead of at their expect deadline (cluster.transport.base.KVSender.send_abort)."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from cluster.transport.base import KVSender
from cluster.wire.messages import Reservation

log = logging.getLogger(__name__)


class AbortNotices:
    def __init__(self, transport: Callable[[], KVSender | None], timeout_s: Callable[[], float]):
        """`transport` / `timeout_s`: read at each notice (the worker's transport is set after start)."""
        self.transport = transport
        self.timeout_s = timeout_s

    def send(self, reservation: Reservation | None, request_id: str, why: str | None = None) -> None:
        """No reservation (none came yet): nothing to tell. `why`: logged (a notice out of the usual)."""
        transport = self.transport()
        if transport is None or reservation is None:
            return
        if why is not None:
            log.info("reservation %d for %s aborted: %s", reservation.transfer_seq, request_id, why)
        timeout_s = self.timeout_s()

        def run():
            try:
                transport.send_abort(reservation, request_id, timeout_s)
            except Exception:
                pass  # the decode side's expect timeout covers a transport that cannot say it

        threading.Thread(target=run, name=f"kv-abort-{request_id}", daemon=True).start()
