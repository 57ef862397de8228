"""KV transfer over torch.distributed point-to-point: gloo (CPU caches, or host-staged from GPU) or NCCL.

Every (prefill, decode) pair gets its own two-rank process group (prefill = rank 0, decode = rank 1),
formed lazily at the pair's first transfer through a PrefixStore of the cluster's one TCPStore. Why not
one world group: a gloo receive that times out signals the error to the whole gloo context and NCCL
communicators cannot be recovered after a timeout, so one silent peer would take every transfer of the
process down with it. With a group per pair, a failure marks that peer dead, fails its pending
transfers, and leaves every other pair working. No global ranks to hand out either.

One transfer (the control plane is in control.py):
  prefill: claim header -> wait "r" (decode posted its receives) -> send 2*L messages (layer i's K, V)
           -> wait "a" (landed) -> free its own blocks.
  decode:  read header -> post 2*L receives, straight into the reserved blocks if they are contiguous,
           else into a staging buffer scattered with one index_copy_ -> "r" -> wait -> "a" -> KVArrival.
The decode side's receiver thread hands out "r" in transfer_seq order, so payloads of a pair never
interleave and prefills that finish out of order simply wait for their turn.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from cluster.messages import Reservation
from cluster.transport.control import PeerDeadError, StoreCoordinatedTransport, TransferRejected, local_address_towards


class TorchDistTransport(StoreCoordinatedTransport):
    def __init__(self, spec, kv_cache, worker_id, role, store_factory):
        super().__init__(spec, kv_cache, worker_id, role, store_factory)
        self.backend = spec.backend
        if self.backend == "nccl" and kv_cache.device.type != "cuda":
            raise ValueError("the nccl backend needs a KV cache on a CUDA device")
        # The payload travels on the host when gloo carries a GPU cache (host-staged).
        self.payload_device = kv_cache.device if self.backend == "nccl" else torch.device("cpu")
        self.staged = self.payload_device != kv_cache.device
        self._groups: dict[str, object] = {}
        self._group_locks: dict[str, threading.Lock] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._copy_stream = torch.cuda.Stream(kv_cache.device) if kv_cache.device.type == "cuda" else None

    # -- the pair's process group ---------------------------------------------------------------
    def _group(self, peer: str):
        with self._lock:
            lock = self._group_locks.setdefault(peer, threading.Lock())
        with lock:
            if peer in self._dead:
                raise PeerDeadError(f"peer {peer} is marked dead: {self._dead[peer]}")
            pg = self._groups.get(peer)
            if pg is None:
                prefill, decode = (self.worker_id, peer) if self.role == "prefill" else (peer, self.worker_id)
                rank = 0 if self.role == "prefill" else 1
                store = dist.PrefixStore(f"{self.ns}/pg/{prefill}/{decode}/", self._new_store())
                timeout = datetime.timedelta(seconds=self.spec.transfer_timeout_s)
                if self.backend == "nccl":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = timeout
                    torch.cuda.set_device(self.kv_cache.device)
                    pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
                else:
                    host = self.spec.bind_host or local_address_towards(self.spec.store_host or "127.0.0.1", self.spec.store_port)
                    opts = dist.ProcessGroupGloo._Options()
                    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                    opts._timeout = timeout
                    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
                self._groups[peer] = pg
            return pg

    def _on_peer_dead(self, peer: str) -> None:
        pg = self._groups.pop(peer, None)
        if pg is not None and self.backend == "nccl" and hasattr(pg, "abort"):
            # NOTE: a timed-out NCCL receive is still queued on the device and would land whenever the
            # data came; aborting the communicator is what makes freeing its target blocks safe.
            try:
                pg.abort()
            except Exception:
                pass

    def _layer_messages(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """buf [L, 2, n, ...] -> the 2*L contiguous messages of one transfer, in tag order."""
        return [buf[i, j] for i in range(buf.shape[0]) for j in range(2)]

    # -- prefill side ---------------------------------------------------------------------------
    def _push(self, store, reservation: Reservation, src_block_ids: list[int], deadline: float) -> int:
        peer, seq = reservation.decode_worker_id, reservation.transfer_seq
        # The decode side answers in transfer_seq order, so this may wait behind our own earlier
        # transfers (still prefilling): bounded like the decode side's own wait, while heartbeats
        # catch a dead peer within peer_timeout_s.
        turn = time.monotonic() + self.spec.expect_timeout_s
        if peer not in self._groups:
            # Form the pair's group only once the decode side is forming it too (it says so with "join"
            # right before its constructor blocks), so a dead decode worker can't hold us in there.
            jkey = f"{self.ns}/pg/{self.worker_id}/{peer}/join"
            if self._wait_key(store, jkey, peer, max(deadline, turn), "the pair's group formation") is None:
                raise TimeoutError(f"decode worker {peer} never started forming the transfer group")
        pg = self._group(peer)
        rkey = self._key(self.worker_id, peer, seq, "r")
        ready = self._wait_key(store, rkey, peer, max(deadline, turn), f"receives of transfer {seq}")
        if ready is None:
            raise TimeoutError(f"decode worker {peer} did not post receives for transfer {seq} in time")
        store.delete_key(rkey)
        if ready != b"1":
            raise TransferRejected(f"decode worker {peer} rejected transfer {seq}: {ready.decode(errors='replace')}")
        idx = torch.tensor(src_block_ids, dtype=torch.long, device=self.kv_cache.device)
        works, keep = [], []
        if self.backend == "nccl":
            # Layer by layer: layer i's gather and send are queued before layer i+1's, so NCCL starts
            # moving layer 0 while the later gathers still run.
            for i in range(self.kv_cache.shape[0]):
                g = self.kv_cache[i].index_select(1, idx)  # [2, n, bs, kvh, hd]
                keep.append(g)
                works += [pg.send([g[0]], 1, 2 * i), pg.send([g[1]], 1, 2 * i + 1)]
        else:
            buf = self.kv_cache.index_select(2, idx)
            if self.staged:
                with torch.cuda.stream(self._copy_stream):
                    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
                    host.copy_(buf, non_blocking=True)
                self._copy_stream.synchronize()
                buf = host
            keep.append(buf)
            works = [pg.send([m], 1, tag) for tag, m in enumerate(self._layer_messages(buf))]
        for w in works:
            w.wait()
        deadline = time.monotonic() + self.spec.transfer_timeout_s
        akey = self._key(self.worker_id, peer, seq, "a")
        landed = self._wait_key(store, akey, peer, deadline, f"acknowledgement of transfer {seq}")
        if landed is None:
            raise TimeoutError(f"decode worker {peer} did not acknowledge transfer {seq} in time")
        store.delete_key(akey)
        if landed != b"1":
            raise RuntimeError(f"decode worker {peer} failed to land transfer {seq}: {landed.decode(errors='replace')}")
        return len(src_block_ids) * self.bytes_per_block

    # -- decode side ----------------------------------------------------------------------------
    def _pull(self, store, peer: str, res: Reservation, nblocks: int, deadline: float) -> int:
        seq = res.transfer_seq
        dst = list(res.block_ids[:nblocks])
        if peer not in self._groups:
            store.set(f"{self.ns}/pg/{peer}/{self.worker_id}/join", b"1")
        pg = self._group(peer)
        cache = self.kv_cache
        direct = not self.staged and dst == list(range(dst[0], dst[0] + nblocks))
        if direct:  # receive straight into the reserved blocks: [i, j, d0:d0+n] is contiguous
            d0 = dst[0]
            msgs = [cache[i, j, d0:d0 + nblocks] for i in range(cache.shape[0]) for j in range(2)]
        else:
            shape = (cache.shape[0], 2, nblocks) + tuple(cache.shape[3:])
            staging = torch.empty(shape, dtype=cache.dtype, device=self.payload_device,
                                  pin_memory=self.staged)
            msgs = self._layer_messages(staging)
        rkey = self._key(peer, self.worker_id, seq, "r")
        if self.backend == "nccl":
            # NCCL creates the pair's communicator lazily, inside the first send/recv, and a receive
            # blocks there until the sender joins: say "ready" first, or both sides wait forever.
            store.set(rkey, b"1")
        works = [pg.recv([m], 0, tag) for tag, m in enumerate(msgs)]
        if self.backend != "nccl":
            store.set(rkey, b"1")
        for w in works:
            w.wait()  # bounded by the group's timeout (transfer_timeout_s); raises if the peer broke
        if not direct:
            idx = torch.tensor(dst, dtype=torch.long, device=cache.device)
            cache.index_copy_(2, idx, staging.to(cache.device, non_blocking=True))
        if cache.device.type == "cuda":
            torch.cuda.current_stream(cache.device).synchronize()  # landed before anyone reads it
        store.set(self._key(peer, self.worker_id, seq, "a"), b"1")
        return nblocks * self.bytes_per_block
