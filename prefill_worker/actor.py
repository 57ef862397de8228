"""PrefillWorkerActor: the Ray face of PrefillWorker. The launcher makes it an actor:

    Actor = ray.remote(num_gpus=1)(PrefillWorkerActor)      # an async actor: many submits in flight
    w = Actor.remote("prefill-0", cfg)
    ray.get([w.init_transport.remote(spec) for w in all_workers])
    ray.get([w.connect_transport.remote(decode_ids) for w in prefill_workers])  # before /ready
    result = await w.submit.remote(task)                      # -> PrefillResult
    # or, the router's way: the task as a ZMQ frame to stats().extra["dispatch"] and its answer as a
    # frame back (cluster/wire/prefill_dispatch.py), with one w.lifeline.remote(incarnation) pending
    # per router: it fails when the actor dies, and the router fails the dispatches still unanswered

Only small typed messages cross Ray; the KV goes through the transport. Its methods are the prefill
worker interface, cluster.worker_api.PrefillWorkerAPI, and the fault interface the tests and the chaos
run use, cluster.faults.fault_control.FaultControl (both documented there).

Tensor parallelism (cfg.tensor_parallel_size > 1): this actor is rank 0 and starts its followers through
`rank_launcher`, as DecodeWorkerActor does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from concurrent.futures import Future

from cluster.wire.messages import KVCacheEvents, PrefillResult, PrefillTask, Reservation, WorkerStats
from cluster.transport.factory import TransportSpec, create_transport
from cluster.transport.rendezvous_store import local_address_towards
from cluster.worker.startup_heap import freeze_startup_heap
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.worker_model import lead_group
from prefill_worker.dispatch_inbox import DispatchInbox
from prefill_worker.prefill_worker import PrefillWorker


class PrefillWorkerActor:
    def __init__(self, worker_id: str, cfg: WorkerConfig, rank_launcher=None):
        # A Ray restart runs this again: a new incarnation (see DecodeWorkerActor.__init__).
        self.incarnation = uuid.uuid4().hex
        group = None
        if cfg.tensor_parallel_size > 1:
            if rank_launcher is None:
                raise ValueError(f"prefill worker {worker_id} has tensor_parallel_size {cfg.tensor_parallel_size} "
                                 "but no rank launcher to start its followers")
            group = lead_group(cfg, rank_launcher.launch)
        self.worker = PrefillWorker(worker_id, cfg, group=group).start()
        self.dispatch: DispatchInbox | None = None  # once the transport is given (init_transport)
        self._lifeline: asyncio.Future | None = None  # resolved by shutdown (on the actor's loop)
        # HAZARD: submit runs on the dispatch inbox's thread, attach and abort on this actor's loop.
        # Each reads calls_ahead.py's ledger and then changes the worker's jobs in two locked steps: an
        # attach between a submit's two would be held for a prompt already taken, and wait for ever.
        # They run one at a time under this lock, as they did when all three were calls on the loop.
        self._intake = threading.Lock()

    def init_transport(self, spec: TransportSpec) -> None:
        """Connects to the cluster's store; returns at once (connect_transport forms the pairs). Once
        per incarnation: a second call (a rejoin retried after its pairs failed to form) keeps the
        transport, whose connect() re-forms what failed. A second transport would be a second
        incarnation, and closing the first would mark the worker's heartbeat shut down under it."""
        if self.worker.transport is not None:
            return
        w = self.worker
        w.set_transport(create_transport(spec, w.kv_cache, w.worker_id, "prefill", group=w.group,
                                         kv_heads=w.arch.num_kv_heads, numerics=w.kv_numerics_info()),
                        send_timeout_s=spec.transfer_timeout_s)
        # The router's dispatches come here (prefill_worker/dispatch_inbox.py), on the address the KV
        # control inbox binds: this host's on the route to the launcher's store.
        host = (spec.bind_host or local_address_towards(spec.store_host, spec.store_port)) if spec.store_host else None
        self.dispatch = DispatchInbox(host, w.worker_id, self.incarnation, self._submit, spec.secret).start()

    async def connect_transport(self, decode_worker_ids: list[str]) -> dict[str, float]:
        """Forms and warms the KV channel to every decode worker (seconds each); returns when done.
        Every decode worker's init_transport must have been called (it publishes its endpoint). On a
        thread: the actor's loop goes on answering (stats, peer_died: a peer that dies while its pair
        forms fails that pair at once)."""
        return await asyncio.to_thread(self.worker.transport.connect, decode_worker_ids)

    async def warmup(self) -> dict:
        """Before serving (the launcher calls it before /ready): every prefill shape class, twice.
        Off the actor's event loop, so stats() still answers meanwhile. Then this process's startup heap
        is frozen (cluster/worker/startup_heap.py): its record is the warm-up's `heap`."""
        info = await asyncio.to_thread(self.worker.warmup)
        info["heap"] = freeze_startup_heap()  # (the worker's warmup_info: its stats show it too)
        return info

    def _submit(self, task: PrefillTask) -> Future:
        with self._intake:
            return self.worker.submit(task)

    async def submit(self, task: PrefillTask) -> PrefillResult:
        return await asyncio.wrap_future(self._submit(task))

    async def lifeline(self, incarnation: str) -> str:
        if incarnation != self.incarnation:
            raise RuntimeError(f"prefill worker {self.worker.worker_id} is incarnation {self.incarnation}, not "
                               f"{incarnation}: it restarted")
        if self._lifeline is None:
            self._lifeline = asyncio.get_running_loop().create_future()
        # shield: one caller giving up (its router closing) must not end the others' wait
        return await asyncio.shield(self._lifeline)

    def attach(self, request_id: str, reservation: Reservation) -> None:
        with self._intake:
            self.worker.attach(request_id, reservation)

    def abort(self, request_id: str) -> None:
        with self._intake:
            self.worker.abort(request_id)

    def peer_died(self, peer: str, why: str) -> None:
        """A decode peer is dead (the router heard it from Ray): transfers to it fail now."""
        t = self.worker.transport
        if t is not None and hasattr(t, "peer_died"):
            t.peer_died(peer, why)

    def stats(self) -> WorkerStats:
        s = self.worker.stats()
        extra = {**s.extra, "incarnation": self.incarnation}
        if self.dispatch is not None:
            extra.update(dispatch=self.dispatch.endpoint, dispatch_received=self.dispatch.received,
                         dispatch_frames_rejected=self.dispatch.rejected)
        return dataclasses.replace(s, extra=extra)

    def kv_events(self, epoch: str | None, seq: int) -> KVCacheEvents:
        return self.worker.kv_events(epoch, seq)

    def check_blocks(self) -> None:
        self.worker.check_blocks()

    def transfer_metrics(self) -> dict:
        t = self.worker.transport
        return t.metrics() if t is not None and hasattr(t, "metrics") else {}

    def inject_transport_fault(self, kind: str, seconds: float = 0.0) -> None:
        self.worker.transport.inject_fault(kind, seconds)

    def shutdown(self) -> None:
        life = self._lifeline
        if life is not None and not life.get_loop().is_closed():
            # (threadsafe: which thread Ray runs a sync method of an async actor on is Ray's choice)
            life.get_loop().call_soon_threadsafe(lambda: life.done() or life.set_result("shut down"))
        if self.dispatch is not None:
            self.dispatch.close()
        self.worker.shutdown()
        if self.worker.transport is not None:
            self.worker.transport.close()
