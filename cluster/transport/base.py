"""The KV transport interface: moves a prompt's K/V from a prefill worker's cache into blocks a
decode worker reserved for it.

Ownership protocol (both sides must keep it):
1. The decode worker reserves blocks first (`Reservation`, with a per-(prefill, decode) transfer_seq)
   and calls `expect(reservation, prefill_worker_id)`; from then on those blocks belong to the
   transfer until it lands, fails or times out, and are never handed to another request before.
2. The prefill worker *claims* the transfer before any byte can reach those blocks (`begin`, before
   the prompt's last forward). The decode side may *cancel* it instead (its expect deadline passed, or
   `cancel`); exactly one of the two wins, atomically. After a cancel nothing can land in the blocks.
3. The decode worker learns of finished transfers from `poll_arrivals()`; a request starts decoding
   only after its arrival reports that every layer and the first token arrived. A failed or aborted
   transfer arrives with `error` set (and `header.ok == False` when the prefill said so), only once
   nothing can still write its blocks; they go back to the pool then, not before.
4. The prefill worker frees its own copy only once its side of the payload is done (the futures).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cluster.sampling.logprobs import PrefillLogprobs
from cluster.wire.messages import KVHeader, Reservation


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


@dataclass(frozen=True)
class KVSend:
    """Prefill side: one prompt's KV, its blocks in this worker's cache, bound for a reservation."""

    reservation: Reservation
    num_tokens: int
    src_block_ids: tuple[int, ...]


class Shipment(ABC):
    """The transfers one prefill forward ships, claimed before the forward (`KVSender.begin`).

    The caller reports progress from the thread that runs the forward: `layer_done(i)` once layer i's
    K/V is enqueued on the current stream (a forward hook), `kv_done()` after the forward, `commit()`
    with the first tokens after sampling. `futures[request_id]` resolves to TransferStats once this
    side's payload is done (the source blocks may be reused), or to the exception that failed it."""

    futures: dict[str, Future]

    @abstractmethod
    def layer_done(self, layer: int) -> None: ...

    @abstractmethod
    def kv_done(self) -> None: ...

    @abstractmethod
    def commit(self, first_tokens: Mapping[str, int | None],
               logprobs: Mapping[str, PrefillLogprobs] | None = None) -> None:
        """first_tokens[request_id]: the sampled token, or None (the prompt failed or was aborted:
        its decode side frees the blocks). Missing ids count as None. logprobs[request_id]: the first
        token's and the prompt's, for the requests that ask (they reach the decode side's KVHeader)."""


class KVSender(ABC):
    """The prefill side. One instance per worker process, bound to that worker's KV cache."""

    @abstractmethod
    def connect(self, decode_worker_ids: Sequence[str]) -> dict[str, float]:
        """Forms and warms the payload channel to each decode worker (seconds per peer), so that no
        transfer pays for it. Transfers to a peer not connected yet connect first."""

    @abstractmethod
    def begin(self, sends: Sequence[KVSend], layerwise: bool | None = None) -> Shipment:
        """Claims every transfer and announces it to its decode worker; never raises for one transfer
        (its future fails instead: TimeoutError if the decode side had given up, PeerDeadError...).
        layerwise=None: by prompt length (the transport's layerwise_min_tokens)."""

    @abstractmethod
    def send_abort(self, reservation: Reservation, request_id: str, timeout_s: float) -> None:
        """Tells the decode side that this transfer carries no KV (prefill failed or aborted)."""

    def send(self, reservation: Reservation, header: KVHeader, src_block_ids: Sequence[int], timeout_s: float) -> TransferStats:
        """One transfer, start to end (tests, benchmarks): begin, kv_done, commit, wait."""
        if header.transfer_seq != reservation.transfer_seq or header.request_id != reservation.request_id:
            raise ValueError(f"header {header} does not match reservation {reservation}")
        if not header.ok:
            self.send_abort(reservation, header.request_id, timeout_s)
            return TransferStats(0, 0.0)
        sh = self.begin([KVSend(reservation, header.num_tokens, tuple(src_block_ids))], layerwise=False)
        sh.kv_done()
        sh.commit({header.request_id: header.first_token},
                  {header.request_id: header.logprobs} if header.logprobs is not None else None)
        return sh.futures[header.request_id].result(timeout=timeout_s)

    def close(self) -> None:
        pass


class KVReceiver(ABC):
    """The decode side. One instance per worker process, bound to that worker's KV pool."""

    @abstractmethod
    def expect(self, reservation: Reservation, prefill_worker_id: str) -> None:
        """The reserved blocks now wait for this transfer. Never blocks the caller."""

    @abstractmethod
    def poll_arrivals(self) -> list[KVArrival]:
        """Transfers finished since the last call. Never blocks (called from the decode loop)."""

    @abstractmethod
    def cancel(self, reservation: Reservation, prefill_worker_id: str) -> None:
        """Stop waiting for this transfer as soon as possible. It still arrives: failed, or landed if
        the prefill had claimed it already; the blocks stay reserved until that arrival."""

    @abstractmethod
    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake()` is called (from any thread) when poll_arrivals() may have something new, so the
        decode loop needs no polling back-off while it idles."""

    def close(self) -> None:
        pass


class KVTransport(KVSender, KVReceiver):
    """Both sides in one class; a worker uses the side of its role."""


def kv_cache_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """[layers, 2, len(block_ids), block_size, kv_heads, head_dim]: a gathered copy of those blocks."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(2, idx)
