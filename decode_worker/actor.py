"""DecodeWorkerActor: the Ray face of DecodeWorker. Every method returns at once; the decode loop
runs on the worker's own thread, and tokens leave through the ZMQ token sink, never through Ray.
Its methods are the decode worker interface, cluster.worker_api.DecodeWorkerAPI, and the fault interface
the tests and the chaos run use, cluster.faults.fault_control.DecodeFaultControl (both documented there).

The launcher creates it with e.g. `ray.remote(num_gpus=1)(DecodeWorkerActor).remote(id, cfg, stats_sink)`;
tokens go to the gateway each request names (`GenerateRequest.reply_to`), step records to `stats_sink`.

Tensor parallelism (cfg.tensor_parallel_size = N > 1): this actor is rank 0. Its constructor starts
the N - 1 followers through `rank_launcher` (deploy/ray_rank_launcher.py: actors in this worker's
placement-group bundle, owned by this actor, so they die with it) and forms the group with them; a Ray
restart of this actor starts a new group the same way.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import uuid
from typing import TYPE_CHECKING

from cluster.wire.messages import GenerateRequest, KVCacheEvents, Reservation, ReserveRequest, WorkerStats
from cluster.worker.startup_heap import collect_including_frozen, freeze_startup_heap, heap_frozen
from cluster.worker.worker_config import WorkerConfig
from cluster.engine.worker_model import lead_group
from decode_worker.decode_worker import DecodeWorker

if TYPE_CHECKING:
    from cluster.transport.factory import TransportSpec


class DecodeWorkerActor:
    def __init__(self, worker_id: str, cfg: WorkerConfig, stats_sink: str | None, rank_launcher=None):
        # NOTE: the decode loop shares this interpreter with Ray's call threads, the KV transport's
        # control and waiter threads (the token publisher has a process of its own); with the
        # default 5 ms GIL switch interval the loop could wait that long for the GIL behind one of
        # them, past a whole decode step. This process is the actor's own: nothing else is touched.
        sys.setswitchinterval(0.0005)
        # A Ray restart runs this again: a new incarnation, which the router sees in stats() and has
        # rejoined (KV transport, warm-up) before it places on the worker again.
        self._args = (worker_id, cfg, stats_sink)
        self._group = None
        if cfg.tensor_parallel_size > 1:
            if rank_launcher is None:
                raise ValueError(f"decode worker {worker_id} has tensor_parallel_size {cfg.tensor_parallel_size} "
                                 "but no rank launcher to start its followers")
            self._group = lead_group(cfg, rank_launcher.launch)
        # (worker, incarnation), replaced as one (the fault "restart" brings up a new incarnation in
        # this process): stats() never pairs one incarnation's id with the other's state.
        self._state = (self._new_worker(), uuid.uuid4().hex)

    @property
    def worker(self) -> DecodeWorker:
        return self._state[0]

    @property
    def incarnation(self) -> str:
        return self._state[1]

    def _new_worker(self, model=None) -> DecodeWorker:
        w = DecodeWorker(*self._args, model=model, group=self._group)
        # A tensor-parallel worker is never restarted in place: its followers ran the old one's passes
        # (a new incarnation takes a new group: a Ray restart of this actor). The fault "restart" is refused.
        w.on_restart = self._restart_in_place if self._group is None else None
        return w

    def _restart_in_place(self) -> None:
        """The fault "restart" (DecodeWorker.inject_fault): the old worker's state is dead (its loop
        stopped, nothing more published); a new incarnation takes its place as after a Ray restart,
        without the new process (the model is kept: a test can restart a worker 40 times in a minute).
        The router finds the old one unhealthy, then the new incarnation, and rejoins it."""
        def run():
            old = self.worker
            old.shutdown()  # its transport closes first: its peers see it gone at once
            new = self._new_worker(model=old.model)
            new.faults = old.faults  # what fired stays reported (tests count it)
            self._state = (new, uuid.uuid4().hex)
            del old
            if heap_frozen():  # else the collector finds the old incarnation's cycles on its own
                collect_including_frozen()  # its cycles (they hold its KV cache) were frozen
        threading.Thread(target=run, name="decode-restart-in-place", daemon=True).start()

    def ready(self) -> bool:
        """Returns once the model is loaded and the graphs are captured (the constructor finished)."""
        return True

    def warmup(self) -> dict:
        """Before serving (the launcher calls it before /ready): prefill shapes, the local-prefill
        path and a decode step of every graph variant (DecodeWorker.warmup). Then this process's
        startup heap is frozen (cluster/worker/startup_heap.py): its record is the warm-up's `heap`."""
        info = self.worker.warmup()
        info["heap"] = freeze_startup_heap()  # (the worker's warmup_info: its stats show it too)
        return info

    def reserve(self, req: ReserveRequest) -> Reservation | None:
        return self.worker.reserve(req)

    def submit_local(self, req: GenerateRequest) -> int | None:
        return self.worker.submit_local(req)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def fail(self, request_id: str, error: str) -> None:
        self.worker.abort(request_id, error)

    def peer_died(self, peer: str, why: str) -> None:
        self.worker.peer_died(peer, why)

    def lost(self, request_id: str) -> bool:
        return self.worker.lost(request_id)

    def inject_fault(self, kind: str, after_tokens: int | None = None, seed: int | None = None) -> None:
        self.worker.inject_fault(kind, after_tokens, seed)

    def clear_faults(self) -> None:
        self.worker.clear_faults()

    def stats(self) -> WorkerStats:
        worker, incarnation = self._state
        s = worker.stats()
        return dataclasses.replace(s, extra={**s.extra, "incarnation": incarnation})

    def kv_events(self, epoch: str | None, seq: int) -> KVCacheEvents:
        return self.worker.kv_events(epoch, seq)

    def check_blocks(self) -> None:
        self.worker.check_blocks()

    def step_metrics(self) -> dict:
        return self.worker.step_metrics()

    def init_transport(self, spec: TransportSpec) -> None:
        """Builds the KV transport over this worker's cache; from then on reserve() expects transfers.
        Once per incarnation (see PrefillWorkerActor.init_transport): a second call keeps it."""
        from cluster.transport.factory import create_transport

        w = self.worker
        if w.transport is not None:
            return
        w.attach_transport(create_transport(spec, w.kv_cache, w.worker_id, "decode", group=w.group,
                                            kv_heads=w.arch.num_kv_heads, numerics=w.kv_numerics_info()))

    def transfer_metrics(self) -> dict:
        t = self.worker.transport
        return t.metrics() if t is not None and hasattr(t, "metrics") else {}

    def inject_transport_fault(self, kind: str, seconds: float = 0.0) -> None:
        self.worker.transport.inject_fault(kind, seconds)

    def shutdown(self) -> None:
        self.worker.shutdown()
