"""LoopbackTransport: a test double of the decode side, a KVReceiver within one process, fed by a test
through `send` (test_decode_worker.py).

The real transports (torch.distributed p2p, same-GPU IPC) live in cluster/transport/. This one keeps
their decode-side protocol (expect before send, arrivals through poll_arrivals, failed and cancelled
transfers as arrivals with an error, a wake-up per arrival) with a plain tensor copy, so the decode
worker can be tested end to end on CPU: a test prefills with a cluster.engine.model_runner.ModelRunner over
its own cache, then `send`s the blocks.
"""

from __future__ import annotations

import threading
import time

import torch

from cluster.wire.messages import KVHeader, Reservation
from cluster.transport.base import KVArrival, KVReceiver, TransferStats


class LoopbackTransport(KVReceiver):
    def __init__(self, src_kv_cache: torch.Tensor | None, dst_kv_cache: torch.Tensor):
        self.src = src_kv_cache
        self.dst = dst_kv_cache
        self._lock = threading.Lock()
        self._expected: dict[str, Reservation] = {}
        self._arrivals: list[KVArrival] = []
        self.expect_order: list[tuple[str, int]] = []  # (prefill peer, transfer_seq), for tests
        self.cancelled: list[str] = []  # request ids, for tests
        self._claimed: set[str] = set()
        self._wake = lambda: None

    def set_wakeup(self, wake) -> None:
        self._wake = wake

    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        with self._lock:
            self._expected[reservation.request_id] = reservation
            self.expect_order.append((prefill_worker_id, reservation.transfer_seq))

    def is_expected(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._expected

    def send(self, reservation: Reservation, header: KVHeader, src_block_ids: list[int], timeout_s: float = 10.0) -> TransferStats:
        t0 = time.perf_counter()
        with self._lock:
            if reservation.request_id not in self._expected:
                raise RuntimeError(f"decode side expects no transfer for {reservation.request_id!r}")
        nbytes = 0
        if header.ok and src_block_ids:
            if len(src_block_ids) > len(reservation.block_ids):
                raise RuntimeError(f"{len(src_block_ids)} blocks sent into a reservation of {len(reservation.block_ids)}")
            dst_ids = torch.tensor(reservation.block_ids[: len(src_block_ids)], device=self.dst.device)
            src = self.src.index_select(2, torch.tensor(src_block_ids, device=self.src.device)).to(self.dst.device)
            self.dst.index_copy_(2, dst_ids, src)
            if self.dst.device.type == "cuda":
                torch.cuda.synchronize(self.dst.device)  # landed before the arrival is visible
            nbytes = src.numel() * src.element_size()
        stats = TransferStats(nbytes, time.perf_counter() - t0)
        with self._lock:
            self._expected.pop(reservation.request_id, None)
            self._arrivals.append(KVArrival(reservation, header, stats, None if header.ok else "prefill aborted"))
        self._wake()
        return stats

    def fail(self, reservation: Reservation, error: str) -> None:
        """Reports a transfer as failed (e.g. the prefill worker died)."""
        with self._lock:
            self._expected.pop(reservation.request_id, None)
            self._arrivals.append(KVArrival(reservation, None, TransferStats(0, 0.0), error))
        self._wake()

    def claim(self, reservation: Reservation) -> None:
        """The test's prefill side claims the transfer: a cancel can no longer stop it from landing."""
        with self._lock:
            self._claimed.add(reservation.request_id)

    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        """An unclaimed transfer arrives cancelled at once; a claimed one still lands (or fails)."""
        with self._lock:
            if reservation.request_id in self._claimed or self._expected.pop(reservation.request_id, None) is None:
                return
            self.cancelled.append(reservation.request_id)
            self._arrivals.append(KVArrival(reservation, None, TransferStats(0, 0.0), "cancelled by the decode worker"))
        self._wake()

    def poll_arrivals(self) -> list[KVArrival]:
        with self._lock:
            out, self._arrivals = self._arrivals, []
            return out
