"""ExpectedTransfers: the KV transfers this decode worker's reservations wait for (the scheduler side
of the KV transport, as vLLM v1's KV connector has one).

A reservation (DecodeWorker.reserve) names the blocks a prefill worker writes the prompt's K/V into
and its place in that peer's transfer order (`transfer_seq`, one counter per prefill peer); the
transport is told to expect it. Until its arrival is polled the transfer is pending: an abort or a
failed loop cancels it through the transport (unclaimed, its blocks come back with the failed
arrival; claimed, it lands first). Every method runs under the worker's lock.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterator

from cluster.wire.messages import Reservation, TokenDelta
from cluster.engine.sequence import Sequence
from cluster.transport.base import KVArrival, KVReceiver


class ExpectedTransfers:
    def __init__(self, worker_id: str, block_size: int):
        self.worker_id = worker_id
        self.block_size = block_size
        self.transport: KVReceiver | None = None  # bound by DecodeWorker.attach_transport
        self._transfer_seq: dict[str, int] = defaultdict(int)  # per prefill peer
        # request id -> (reservation, prefill peer) of the transfers that may still land
        self._expected: dict[str, tuple[Reservation, str]] = {}

    def reserve(self, seq: Sequence, peer: str) -> Reservation:
        """The reservation of `seq`'s reserved blocks past its cached ones, expected from `peer`."""
        cached = seq.num_cached_tokens // self.block_size  # the transfer lands after these
        res = Reservation(seq.request_id, self.worker_id, tuple(seq.block_table[cached:]), self._transfer_seq[peer],
                          num_cached_blocks=cached)
        self._transfer_seq[peer] += 1
        if self.transport is not None:
            # Under the lock so that expect() calls reach the transport in transfer_seq order.
            self.transport.expect(res, peer)
            self._expected[seq.request_id] = (res, peer)
        return res

    def pending(self, request_id: str) -> bool:
        """Whether the request's transfer may still land."""
        return request_id in self._expected

    def cancel(self, request_id: str) -> None:
        """Cancels the request's pending transfer, if any (unclaimed: its blocks come back with the
        failed arrival; claimed: it lands first)."""
        pending = self._expected.get(request_id)
        if pending is not None and self.transport is not None:
            self.transport.cancel(*pending)

    def arrivals(self) -> Iterator[KVArrival]:
        """The transport's arrivals (KVArrival) polled now; each is no longer pending."""
        if self.transport is None:
            return
        for a in self.transport.poll_arrivals():
            self._expected.pop(a.reservation.request_id, None)
            yield a

    def landed(self, scheduler, mark_lost: Callable[[str, str], None]) -> list[TokenDelta]:
        """The arrivals polled now, handed to `scheduler` (the worker's DecodeScheduler): the deltas of
        the requests that start decoding or fail. A failed transfer (a broken pair, a dead or stuck
        prefill) is the cluster's failure, not the request's: `mark_lost` tells the router to move it."""
        deltas = []
        for a in self.arrivals():
            rid = a.reservation.request_id
            ok = a.error is None and a.header is not None and a.header.ok
            first = a.header.first_token if ok else None
            d = scheduler.on_arrival(rid, first, ok, a.error, a.header.logprobs if ok else None)
            if d is not None:
                if not ok:
                    mark_lost(rid, a.error or "its KV transfer failed")
                deltas.append(d)
        return deltas
