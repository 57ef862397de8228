"""RayWorkers: the prefill and decode workers of one serving cluster as Ray actors.

- placement: one placement group (PACK), a bundle per worker (its CPUs, its GPU or share of one,
  its role's custom resources; a tensor-parallel worker's bundle holds N GPUs and N actors' CPUs: a
  bundle is on one node, so all its ranks are too); `place` creates every worker's rank-0 actor in its
  bundle (which starts its followers there: deploy/ray_rank_launcher.py) and waits until all have
  loaded the model;
- warm-up: every worker's warmup() at once, before /ready;
- role switches (the P:D planner): `retire` frees a worker's bundle, `spawn` starts a worker of the
  other role in it under a new id, joins it to the KV transport group and warms it up;
- restarts: Ray restarts a dead actor (up to `worker_max_restarts`) as a new incarnation with no KV
  transport; the router's rejoin hook (`rejoin`) joins it to the group again and warms it up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.errors import PdserveError
from decode_worker.actor import DecodeWorkerActor
from decode_worker.rank_follower import DecodeRankFollower
from deploy.component_configs import gpus_per_actor, worker_config
from deploy.config import ClusterConfig
from deploy.kv_transport_group import KVTransportGroup
from deploy.placement_check import unmet
from deploy.ray_rank_launcher import RayRankLauncher
from deploy.ray_runtime import RAY_STOP_BUDGET_S
from prefill_worker.actor import PrefillWorkerActor
from prefill_worker.rank_follower import PrefillRankFollower

_FOLLOWERS = {"prefill": PrefillRankFollower, "decode": DecodeRankFollower}

log = logging.getLogger("pdserve.launch")


def _remote(cls):
    """A Ray actor class of `cls` (a test may pass one already made remote)."""
    return cls if hasattr(cls, "options") else ray.remote(cls)


class RayWorkers:
    def __init__(self, cfg: ClusterConfig, tag: str, *, prefill_actor_cls=None, decode_actor_cls=None,
                 follower_cls: dict[str, Any] | None = None):
        """`tag` names the placement group and prefixes the actors' names; the actor classes (and the
        tensor-parallel followers' by role) default to the real workers' (tests pass fakes)."""
        self.cfg = cfg
        self.tag = tag
        self.prefill: dict[str, Any] = {}  # worker id -> actor handle
        self.decode: dict[str, Any] = {}
        self.placement_group = None
        self.bundle: dict[str, int] = {}  # worker id -> its placement-group bundle
        self.next_index: dict[str, int] = {}  # role -> the next worker id's number
        self.device = "cpu"  # what the workers run on, once placed
        # What the TransportFormer returned: a KVTransportGroup (None without prefill workers, or a
        # test's stand-in); workers started later join it.
        self.kv_group: Any = None
        self._prefill_cls = prefill_actor_cls or PrefillWorkerActor
        self._decode_cls = decode_actor_cls or DecodeWorkerActor
        self._followers = {**_FOLLOWERS, **(follower_cls or {})}
        self._gpus = 0.0
        self._extra: dict[str, dict[str, float]] = {}
        self._worker_cfgs: dict[str, Any] = {}  # role -> its WorkerConfig
        self._stats_sink: str | None = None

    @property
    def handles(self) -> dict[str, Any]:
        """Every worker's handle by id, prefill workers first."""
        return {**self.prefill, **self.decode}

    # -- start-up ---------------------------------------------------------------------------------
    def place(self, model_dir: str, stats_sink: str, cluster_secret: bytes = b"") -> None:
        """Creates the placement group and every worker in it; returns once each has loaded the
        model. `stats_sink`: the router's step-record sink, given to the decode workers;
        `cluster_secret`: the MAC key of the cluster's own sockets (cluster/wire/frame_auth.py)."""
        cfg = self.cfg
        self._prefill_cls, self._decode_cls = _remote(self._prefill_cls), _remote(self._decode_cls)
        gpus = self._gpus = gpus_per_actor(cfg, ray.cluster_resources().get("GPU", 0.0))
        self.device = device = "cuda" if gpus > 0 and cfg.device != "cpu" else "cpu"
        if cfg.device == "cuda" and gpus == 0:
            raise PdserveError("device is cuda but the Ray cluster has no GPU")
        self._worker_cfgs = {role: worker_config(cfg, model_dir, device, gpu_share=gpus if 0 < gpus < 1 else 1.0,
                                                 role=role, cluster_secret=cluster_secret)
                             for role in ("prefill", "decode")}
        self._stats_sink = stats_sink
        roles = [("prefill", i) for i in range(cfg.prefill_workers)] + [("decode", i) for i in range(cfg.decode_workers)]
        self._extra = {"prefill": dict(cfg.prefill_resources), "decode": dict(cfg.decode_resources)}
        # PACK keeps prefill and decode actors together where they fit (cheaper KV transfers) and
        # spreads them over nodes only when one node can't hold them; custom resources in a role's
        # bundle pin that role to the nodes that offer them. A worker's bundle holds all its ranks.
        bundles = [(self._describe(role), self._bundle(role)) for role, _ in roles]
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        missing = unmet(bundles, nodes)
        if missing is not None:
            raise PdserveError(f"the Ray cluster can never place the workers: {missing}. Give Ray more CPUs (or "
                               f"GPUs), or ask less per rank (cpus_per_worker, now {cfg.cpus_per_worker:g})")
        pg = placement_group([b for _, b in bundles], strategy="PACK", name=self.tag)
        self.placement_group = pg
        self._wait_placed(pg, len(roles))
        for k, (role, i) in enumerate(roles):
            self._create_actor(role, f"{role}-{i}", k)
        self.next_index = {"prefill": cfg.prefill_workers, "decode": cfg.decode_workers}
        handles = self.handles
        log.info("waiting for %d workers to load %s on %s", len(handles), model_dir, device)
        refs = {wid: h.stats.remote() for wid, h in handles.items()}
        try:
            ray.get(list(refs.values()), timeout=cfg.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PdserveError(f"workers did not start within {cfg.ready_timeout_s:g}s") from None
        except ray.exceptions.RayActorError as e:
            cause = str(e).strip().splitlines()
            raise PdserveError(f"a worker failed to start: {cause[-1] if cause else e}") from None

    def _wait_placed(self, pg, n: int) -> None:
        """Waits up to placement_timeout_s for the placement group (its resources exist, but others
        may hold them now), saying every 10 s what it waits for; then a PdserveError."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.placement_timeout_s
        while True:
            try:
                ray.get(pg.ready(), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                return
            except ray.exceptions.GetTimeoutError:
                waiting = (f"{n} workers' bundles ({self._bundle('prefill')} per prefill worker, "
                           f"{self._bundle('decode')} per decode worker; free now: {ray.available_resources()})")
                if time.monotonic() >= deadline:
                    remove_placement_group(pg)
                    self.placement_group = None
                    raise PdserveError(f"the Ray cluster did not place {waiting} within "
                                       f"{cfg.placement_timeout_s:g}s (placement_timeout_s)") from None
                log.warning("waiting for Ray to place %s", waiting)

    def _describe(self, role: str) -> str:
        tp = self.cfg.tp_of(role)
        return f"a {role} worker" + (f" of TP {tp} ({tp} ranks)" if tp > 1 else "")

    def _bundle(self, role: str) -> dict[str, float]:
        """A worker's bundle: each of its ranks' CPUs and GPU, and its role's custom resources (asked by
        its rank 0 alone)."""
        tp = self.cfg.tp_of(role)
        return {"CPU": self.cfg.cpus_per_worker * tp, **({"GPU": self._gpus * tp} if self._gpus else {}),
                **self._extra[role]}

    def _create_actor(self, role: str, wid: str, bundle_index: int):
        wcfg = self._worker_cfgs[role]
        launcher = None
        if wcfg.tensor_parallel_size > 1:
            launcher = RayRankLauncher(self._followers[role], wid, wcfg, self.placement_group, bundle_index,
                                       self.cfg.cpus_per_worker, self._gpus)
        opts = dict(num_cpus=self.cfg.cpus_per_worker, num_gpus=self._gpus, name=f"{self.tag}-{wid}",
                    resources=self._extra[role] or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                         placement_group_bundle_index=bundle_index),
                    # A restarted actor reruns __init__ (a new incarnation) and rejoins through the
                    # router's rejoin hook (rejoin); no call is retried: the router moves what a dead
                    # worker held.
                    max_restarts=self.cfg.worker_max_restarts, max_task_retries=0)
        tp = {} if launcher is None else {"rank_launcher": launcher}
        if role == "prefill":
            h = self.prefill[wid] = self._prefill_cls.options(**opts).remote(wid, wcfg, **tp)
        else:
            h = self.decode[wid] = self._decode_cls.options(**opts).remote(wid, wcfg, self._stats_sink, **tp)
        self.bundle[wid] = bundle_index
        return h

    def warm_up(self, handles: dict[str, Any]) -> None:
        """Every worker's warmup(), all at once; returns when all are done (before /ready)."""
        handles = {wid: h for wid, h in handles.items() if hasattr(h, "warmup")}
        if not handles:
            return
        t0 = time.monotonic()
        try:
            done = ray.get([h.warmup.remote() for h in handles.values()], timeout=self.cfg.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PdserveError(f"workers did not warm up within {self.cfg.ready_timeout_s:g}s") from None
        except ray.exceptions.RayActorError as e:
            cause = str(e).strip().splitlines()
            raise PdserveError(f"a worker failed to warm up: {cause[-1] if cause else e}") from None
        log.info("warmed up %d workers in %.1fs: %s", len(handles), time.monotonic() - t0, dict(zip(handles, done)))

    # -- role switches (the P:D planner) ----------------------------------------------------------
    def retire(self, worker_id: str) -> int:
        """Shuts a worker's actor down and frees its GPU (the router must have let go of it first);
        returns its placement-group bundle, for the worker that takes its place. Blocking."""
        h = self.prefill.pop(worker_id, None) or self.decode.pop(worker_id)
        try:
            ray.get(h.shutdown.remote(), timeout=10)
        except Exception:
            pass  # it may already be gone; the kill below frees its resources anyway
        ray.kill(h)
        return self.bundle.pop(worker_id)

    def spawn(self, role: str, bundle_index: int) -> tuple[str, Any]:
        """Starts a worker of `role` in a bundle (a GPU) a retired worker left, joins it to the KV
        transport group and warms it up; returns (its new id, its handle) once it can serve. New ids
        only: transfer pairs and their sequence numbers are per pair of ids. Blocking."""
        wid = f"{role}-{self.next_index[role]}"
        self.next_index[role] += 1
        h = self._create_actor(role, wid, bundle_index)
        try:
            ray.get(h.stats.remote(), timeout=self.cfg.ready_timeout_s)  # loaded (the old one is gone by now)
            if isinstance(self.kv_group, KVTransportGroup):
                self.kv_group.join({wid: h}, self.prefill, self.decode, self.cfg.ready_timeout_s)
            if self.cfg.warmup:
                self.warm_up({wid: h})
        except BaseException:
            self.retire(wid)
            raise
        return wid, h

    # -- restarts --------------------------------------------------------------------------------
    async def rejoin(self, worker_id: str, role: str, peers: list[str]) -> None:
        """The router's rejoin hook: Ray restarted the worker's actor (a new incarnation, no transport
        yet). Joins it to the KV transport group with the healthy workers of the other role, `peers`
        (a prefill worker forms its pairs to them; each of them forms its pair to a decode worker:
        the pair of its old incarnation is re-formed), then warms it up. A peer restarting meanwhile
        forms the pair when it rejoins itself (or on its first transfer)."""
        await asyncio.get_running_loop().run_in_executor(None, self._rejoin_blocking, worker_id, role, peers)

    def _rejoin_blocking(self, worker_id: str, role: str, peers: list[str]) -> None:
        h = (self.prefill if role == "prefill" else self.decode)[worker_id]
        if isinstance(self.kv_group, KVTransportGroup):
            if role == "prefill":
                prefill, decode = {worker_id: h}, {d: self.decode[d] for d in peers}
            else:
                prefill, decode = {p: self.prefill[p] for p in peers}, {worker_id: h}
            self.kv_group.join({worker_id: h}, prefill, decode, self.cfg.ready_timeout_s)
        if self.cfg.warmup:
            self.warm_up({worker_id: h})

    async def gone(self, worker_id: str) -> bool:
        """The router's gone check: the worker's actor is dead for good (Ray gave up restarting it, or
        it was killed without restart), as Ray's actor table says."""
        h = self.prefill.get(worker_id) or self.decode.get(worker_id)
        if h is None:
            return True

        def state() -> str | None:
            # NOTE: ray._private.state is Ray's own actor table (the state API needs the dashboard).
            from ray._private import state as ray_state

            return ray_state.actors(actor_id=h._actor_id.hex()).get("State")
        return await asyncio.get_running_loop().run_in_executor(None, state) == "DEAD"

    # -- shutdown ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Every worker's shutdown() (a third of the stop budget at most), then kills them all and
        removes the placement group. Needs Ray to answer: the caller runs it within its budget."""
        handles = [*self.prefill.values(), *self.decode.values()]
        refs = [h.shutdown.remote() for h in handles]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=RAY_STOP_BUDGET_S / 3)
        except Exception:
            pass
        for h in handles:
            try:
                ray.kill(h)
            except Exception:
                pass
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
