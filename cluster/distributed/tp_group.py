"""TPGroup: one worker's tensor-parallel group as one of its ranks sees it. Each rank is its own process
(one per GPU: a Ray actor in a served cluster, a spawned process in tests and benchmarks); rank 0 is the
worker (the router, the scheduler, the KV transport's control all talk to it) and the others follow.

Forming it (`TPGroup.leader` on rank 0, `TPGroup.follower` on the others):
1. rank 0 hosts the group's store (a TCPStore on the node's loopback: the ranks share a node) and
   launches the followers with a `TPRendezvous` (where the store is, the group's namespace, timeouts,
   and the group's own secret: every value in the store is sealed under it, AuthenticatedStore, so a
   local user who reaches the store's port can neither redirect a rank nor join the group);
2. each follower binds its step socket (step_channel.py: an ipc:// path in a directory only this user
   can enter, which is all the step and RPC channels accept), publishes it, says it arrived; rank 0 waits
   for every follower within `join_timeout_s` (a follower that fails to start fails the worker);
3. every rank joins the torch.distributed world group (gloo on CPU, NCCL on CUDA, collectives time out
   after `collective_timeout_s`), the CUDA ranks set up the symmetric-memory one-shot all-reduce
   (communicator.py; all or none of them), and each starts its RankWatchdog (watchdog.py).
NVLink multicast is switched off before any communicator exists (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

Then rank 0 `publish`es a step message before each forward pass and the followers `recv` them
(cluster/distributed/follower.py). Work that is not a pass goes over the group's `rpc` (rank_rpc.py:
rank 0 calls a follower, a follower notifies rank 0; the KV transport's payload agents use it). The group's `comm` (TPCommunicator) is what the sharded model calls.
A rank that cannot go on (a peer died, a pass failed part way: the ranks' collectives would no longer
pair up) calls `fail(why)`: by default its process ends, and so, through their watchdogs, do its
peers'.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from cluster.distributed.communicator import ONE_SHOT_MAX_BYTES, OneShotAllReduce, TPCommunicator
from cluster.distributed.rank_rpc import RankRPC
from cluster.distributed.step_channel import StepPublisher, StepSubscriber
from cluster.distributed.step_messages import StepMessage, Stop
from cluster.distributed.watchdog import RankWatchdog, exit_process
from cluster.transport.authenticated_store import AuthenticatedStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPRendezvous:
    """What a follower needs to join rank 0's group (picklable: Ray and multiprocessing pass it)."""

    host: str
    port: int
    namespace: str
    size: int
    join_timeout_s: float = 300.0  # rank 0 waits this long for every follower to arrive
    collective_timeout_s: float = 60.0  # a collective that waits this long fails (a hung peer)
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 10.0  # a rank whose heartbeat stalls this long is dead
    secret: bytes = field(default=b"", repr=False)  # the group's (drawn by rank 0): the store's MAC key


def _disable_multicast() -> None:
    # NOTE: forced, not defaulted: NVLink SHARP / multicast must stay off whatever the environment says.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def _client(rdv: TPRendezvous, timeout_s: float) -> AuthenticatedStore:
    return AuthenticatedStore(dist.TCPStore(rdv.host, rdv.port, is_master=False, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True),
                              rdv.secret)


class TPGroup:
    def __init__(self, rdv: TPRendezvous, rank: int, device: torch.device, dtype: torch.dtype, master=None,
                 on_failure: Callable[[str], None] = exit_process):
        self.rdv, self.rank, self.size = rdv, rank, rdv.size
        self.device = torch.device(device)
        self.dtype = dtype
        self.on_failure = on_failure
        self.failed: str | None = None
        self._master = master  # rank 0: the store itself (kept alive as long as the group)
        self._store = AuthenticatedStore(master, rdv.secret) if master is not None else _client(rdv, rdv.join_timeout_s)
        self.publisher: StepPublisher | None = None
        self.subscriber: StepSubscriber | None = None
        self.watchdog: RankWatchdog | None = None
        self.comm: TPCommunicator | None = None
        self.rpc = RankRPC(rank)
        self.info: dict[int, dict] = {}  # rank -> what it reported on arrival (pid, node, GPUs)
        self.launched: Any = None  # rank 0: what launch() returned (the followers' handles: a Ray actor
        # lives as long as a handle to it)
        self._closed = False

    # -- forming ----------------------------------------------------------------------------------
    @classmethod
    def leader(cls, size: int, device, dtype: torch.dtype, launch: Callable[[TPRendezvous], Any], *,
               on_failure: Callable[[str], None] = exit_process, describe: Callable[[], dict] | None = None,
               **timeouts) -> "TPGroup":
        """Rank 0: hosts the store, calls `launch(rendezvous)` (which starts ranks 1..size-1 with it and
        returns at once), then forms the group with them. Blocking."""
        from cluster.transport.rendezvous_store import start_store

        # In this process, not in a capped one of its own like the cluster's (store_process.py): it
        # listens on loopback only (no other host reaches it) and every value in it is sealed under the
        # group's own secret, so it can be forged by nobody; a local user who fills it can take down
        # this worker (the router moves its requests, as for any worker death), never the launcher.
        # A capped process per TP worker would cost ~1.3 s of CPU and ~250 MiB (torch) each.
        # (RELIABILITY.md, security: what stays out of scope.)
        master = start_store("127.0.0.1", 0, timeout_s=timeouts.get("join_timeout_s", 300.0))
        rdv = TPRendezvous("127.0.0.1", master.port, f"tp-{uuid.uuid4().hex[:12]}", size, **timeouts,
                           secret=os.urandom(32))
        g = cls(rdv, 0, device, dtype, master, on_failure)
        g.launched = launch(rdv)
        g._arrive(describe)
        g._join()
        return g

    @classmethod
    def follower(cls, rdv: TPRendezvous, rank: int, device, dtype: torch.dtype, *,
                 on_failure: Callable[[str], None] = exit_process, describe: Callable[[], dict] | None = None
                 ) -> "TPGroup":
        g = cls(rdv, rank, device, dtype, None, on_failure)
        g.subscriber = StepSubscriber()
        g._arrive(describe)
        g._join()
        return g

    def _key(self, what: str) -> str:
        return f"{self.rdv.namespace}/{what}"

    def _arrive(self, describe) -> None:
        import msgspec

        info = {"pid": os.getpid(), **(describe() if describe is not None else {}), "rpc": self.rpc.endpoint}
        if self.subscriber is not None:
            info["endpoint"] = self.subscriber.endpoint
        self._store.set(self._key(f"arrived/{self.rank}"), msgspec.msgpack.encode(info))
        deadline = time.monotonic() + self.rdv.join_timeout_s
        keys = [self._key(f"arrived/{r}") for r in range(self.size)]
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size) if not self._store.check([keys[r]])]
                raise TimeoutError(f"tensor-parallel ranks {missing} did not start within "
                                   f"join_timeout_s={self.rdv.join_timeout_s}")
            time.sleep(0.02)
        self.info = {r: msgspec.msgpack.decode(self._store.get(keys[r])) for r in range(self.size)}
        if self.rank == 0:
            self.publisher = StepPublisher([self.info[r]["endpoint"] for r in range(1, self.size)])
        self.rpc.connect({r: i["rpc"] for r, i in self.info.items()})

    def _join(self) -> None:
        rdv = self.rdv
        _disable_multicast()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        else:
            # The ranks share the host's cores: intra-op threads that spin while their rank waits in a
            # gloo collective would take the cores the other ranks compute on (20x slower passes seen
            # on 2 cores). Each rank gets its share.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed world group")
        # (dist.PrefixStore cannot wrap a Python store.) HAZARD: kept as long as the group: NCCL reaches
        # its store lazily, and a collected Python store fails there ("Not implemented").
        store = self._pg_store = self._store.prefixed(self._key("pg/"))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=rdv.collective_timeout_s))
        one_shot = None
        if cuda:
            one_shot = self._one_shot()
        self.comm = TPCommunicator(self.rank, self.size, self.device, one_shot)
        self.watchdog = RankWatchdog(lambda: _client(rdv, max(2.0, rdv.peer_timeout_s)), rdv.namespace, self.rank,
                                     self.size, rdv.heartbeat_s, rdv.peer_timeout_s, self._watchdog_failed)
        self.watchdog.start()
        log.info("tensor-parallel rank %d of %d joined (%s, one-shot all-reduce: %s)", self.rank, self.size,
                 self.device, one_shot is not None)

    def _one_shot(self) -> OneShotAllReduce | None:
        """The symmetric-memory all-reduce on every rank, or on none (the ranks agree on it)."""
        max_bytes = ONE_SHOT_MAX_BYTES.get(self.size, 0)
        ok, found = None, "no one-shot size for this group"
        if max_bytes and self.dtype in (torch.bfloat16, torch.float32):
            try:
                ok = OneShotAllReduce(self.device, self.dtype, max_bytes)
            except Exception as e:  # noqa: BLE001 - this build or machine cannot: NCCL for every size
                found = f"{type(e).__name__}: {e}"
        flag = torch.tensor([1 if ok is not None else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 0:
            if ok is not None or found:
                log.warning("one-shot all-reduce unavailable on some rank (%s here); NCCL carries every size", found)
            return None
        return ok

    # -- serving ----------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def publish(self, msg: StepMessage) -> None:
        """Rank 0, before each pass: the followers run the same one."""
        self.publisher.publish(msg)

    def recv(self, timeout_s: float) -> StepMessage | None:
        """A follower: the next pass to run (None: nothing within timeout_s)."""
        return self.subscriber.recv(timeout_s)

    def _watchdog_failed(self, why: str) -> None:
        self.failed = why
        self.on_failure(why)

    def fail(self, why: str) -> None:
        """This rank cannot go on (its collectives may no longer pair up with its peers'): the group ends."""
        if self.failed is None:
            self.failed = why
        if self.watchdog is not None:
            self.watchdog._fail(why)  # marks this rank failed (its peers follow), then on_failure
        else:
            self.on_failure(why)

    def describe(self) -> dict:
        """For the worker's stats: the ranks (pid, node, GPUs each reported on arrival), the all-reduce."""
        return {"size": self.size, "ranks": {str(r): {k: v for k, v in i.items() if k not in ("endpoint", "rpc")}
                                              for r, i in self.info.items()},
                **(self.comm.describe() if self.comm is not None else {})}

    def close(self) -> None:
        """Rank 0: tells the followers to stop. Every rank: leaves the group (marks itself closed)."""
        if self._closed:
            return
        self._closed = True
        if self.publisher is not None:
            try:
                self.publisher.publish(Stop("shutdown"))
            except Exception:  # noqa: BLE001
                pass
        if self.watchdog is not None:
            self.watchdog.stop(clean=True)
        if self.subscriber is not None:
            self.subscriber.close()
        if self.publisher is not None:
            self.publisher.close()
        self.rpc.close()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
            log.exception("leaving the tensor-parallel process group failed")
