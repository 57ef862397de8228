"""The KV transport interface: moves a prompt's K/V from a prefill worker's cache into blocks a
decode worker reserved for it.

Ownership protocol (both sides must keep it):
1. The decode worker reserves blocks first (`Reservation`, with a per-(prefill, decode) transfer_seq)
   and calls `expect(reservation, prefill_worker_id)`; from then on those blocks belong to the
   transfer until it lands, fails or times out, and are never handed to another request before.
2. The prefill worker computes the KV, then calls `send(...)` with the reservation; transfers to one
   decode worker are issued in transfer_seq order (the implementation reorders if needed).
3. The decode worker learns of finished transfers from `poll_arrivals()`; a request starts decoding
   only after its arrival reports the last layer landed. A failed/aborted transfer arrives with
   `header.ok == False` (or `error` set) and its blocks go back to the pool then, not before.
4. The prefill worker frees its own copy only after `send` completes (the decode side confirmed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cluster.messages import KVHeader, Reservation


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class KVArrival:
    """Decode side: one transfer finished (landed, or failed with `error`)."""

    reservation: Reservation
    header: KVHeader | None
    stats: TransferStats
    error: str | None = None


class KVTransport(ABC):
    """One instance per worker process, bound to that worker's KV cache tensor."""

    # -- prefill side ---------------------------------------------------------------------------
    @abstractmethod
    def send(self, reservation: Reservation, header: KVHeader, src_block_ids: list[int], timeout_s: float) -> TransferStats:
        """Copies the K/V of `src_block_ids` (this worker's cache) into `reservation.block_ids` of
        the decode worker. Blocks until the decode side has it; raises TimeoutError / RuntimeError
        with a clear message if the peer is dead or does not answer within timeout_s."""

    def send_abort(self, reservation: Reservation, request_id: str, timeout_s: float) -> None:
        """Tells the decode side that this transfer_seq carries no KV (prefill failed or aborted)."""
        self.send(reservation, KVHeader(request_id, reservation.transfer_seq, 0, -1, ok=False), [], timeout_s)

    # -- decode side ----------------------------------------------------------------------------
    @abstractmethod
    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        """Queues a receive into the reserved blocks. Never blocks the caller."""

    @abstractmethod
    def poll_arrivals(self) -> list[KVArrival]:
        """Transfers finished since the last call. Never blocks (called from the decode loop)."""

    def close(self) -> None:
        pass


def kv_cache_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """[layers, 2, len(block_ids), block_size, kv_heads, head_dim]: a gathered copy of those blocks."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(2, idx)
