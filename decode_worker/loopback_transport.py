"""LoopbackTransport: a KVTransport within one process, between two caches on the same device.

The real transports (torch.distributed p2p, same-GPU IPC) live in cluster/transport/. This one keeps
their protocol (expect before send, arrivals through poll_arrivals, failed transfers as arrivals
with ok=False) with a plain tensor copy, so the decode worker can be tested end to end on CPU: a test
prefills with a cluster.model_runner.ModelRunner over its own cache, then `send`s the blocks.
"""

from __future__ import annotations

import threading
import time

import torch

from cluster.messages import KVHeader, Reservation
from cluster.transport.base import KVArrival, KVTransport, TransferStats


class LoopbackTransport(KVTransport):
    def __init__(self, src_kv_cache: torch.Tensor | None, dst_kv_cache: torch.Tensor):
        self.src = src_kv_cache
        self.dst = dst_kv_cache
        self._lock = threading.Lock()
        self._expected: dict[str, Reservation] = {}
        self._arrivals: list[KVArrival] = []
        self.expect_order: list[tuple[str, int]] = []  # (prefill peer, transfer_seq), for tests

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
        return stats

    def fail(self, reservation: Reservation, error: str) -> None:
        """Reports a transfer as failed (e.g. the prefill worker died)."""
        with self._lock:
            self._expected.pop(reservation.request_id, None)
            self._arrivals.append(KVArrival(reservation, None, TransferStats(0, 0.0), error))

    def poll_arrivals(self) -> list[KVArrival]:
        with self._lock:
            out, self._arrivals = self._arrivals, []
            return out
