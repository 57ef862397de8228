"""`pdserve serve`: starts (or joins) Ray, places the workers, forms the KV transfer group, runs the
router, and starts the API-server processes that serve the OpenAI-compatible HTTP API.

Processes:
- this one, the launcher: the Ray driver, and the one Router (admission, placement, migration) on
  its asyncio loop, served to the gateways by a RouterServer (router/channel/server.py), which also
  collects the decode workers' step records for /stats and /metrics;
- `api_servers` gateway processes (deploy/api_server.py) sharing one listening socket, each
  with its own token sink: decode workers send each of them only its own requests' text;
- the Ray actors (prefill and decode workers).

Start-up order: the router's sockets and the HTTP socket are bound first (a port in use is a one-line
error before anything starts; the gateway processes start importing while the workers load), then
the actors are placed (decode workers get the router's step-record sink) and the transport group is
formed, then every worker warms up (`warmup()`: prefill shapes, the local-prefill path, a decode
step per graph variant; the first request then costs what the hundredth does); /ready turns true
only when the router has polled every worker and every gateway process is up. SIGTERM drains: the router refuses new requests, every gateway lets its in-flight requests finish
(up to `drain_timeout_s`), then everything stops in order and the launcher exits 0.

With `planner` on, a PlannerLoop (deploy/planner_loop.py) runs beside the router and moves
workers between prefill and decode on the GPUs they hold (`spawn_worker` / `retire_worker` here).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from deploy.config import ClusterConfig, add_config_flags, overrides_from_args
from cluster.errors import PdserveError

log = logging.getLogger("pdserve.launch")

# Longest wait for Ray while stopping (workers' shutdown calls, kills, ray.shutdown): `pdserve serve`
# exits within drain_timeout_s + 5 s whatever died first.
_RAY_STOP_BUDGET_S = 3.0


def _gcs_gone() -> bool:
    """True when this process started a local Ray whose GCS server process is no longer among its
    descendants: every Ray call would then wait for it, so nothing is asked of Ray."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        try:
            # A killed GCS stays listed, as a zombie, until Ray's bookkeeping reaps it.
            if p.name().startswith("gcs_server") and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            pass
    return True


def _kill_children() -> None:
    """Kills every process this one started (Ray's GCS, raylet and workers of a local instance)."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        try:
            p.kill()
        except psutil.Error:
            pass


# (prefill handles by id, decode handles by id, cluster config, **where) -> whatever must stay alive
# while serving (a KVTransportGroup); forms the KV transport group.
TransportFormer = Callable[..., Any]


@dataclass
class KVTransportGroup:
    """The KV transport group of a serving cluster: the rendezvous store (keep it alive while
    serving) and the spec every worker was given; a worker that joins later gets the same spec."""

    store: Any
    spec: Any

    def join(self, handles: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any],
             timeout_s: float) -> dict[str, dict[str, float]]:
        """Gives the new workers `handles` the spec, then has every prefill worker in `prefill` form
        and warm its channel to every decode worker in `decode` (pairs formed before are kept, but
        one whose decode worker restarted is formed anew);
        returns the seconds each new pair took, by prefill worker. Blocking.

        All prefill workers at once: each forms its pairs one at a time, in the same order, and a
        decode worker answers hellos in arrival order, so no pair waits on another forever."""
        import ray

        ray.get([h.init_transport.remote(self.spec) for h in handles.values()], timeout=timeout_s)
        warm = ray.get([h.connect_transport.remote(sorted(decode)) for h in prefill.values()], timeout=timeout_s)
        return dict(zip(prefill, warm))


def add_serve_command(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (prefill/decode on Ray)",
                       description=__doc__.split("\n\n")[0])
    s.add_argument("model_dir", nargs="?", default=None, help="Hugging Face model directory (default: the demo model)")
    s.add_argument("--config", default=None, help="YAML file with any of the settings below (flags win)")
    add_config_flags(s)
    s.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> None:
    cfg = ClusterConfig.load(args.config, overrides_from_args(args))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ServingCluster(cfg).serve_forever()


def form_kv_transport_group(prefill: dict[str, Any], decode: dict[str, Any], cfg: ClusterConfig,
                            *, store_host: str = "127.0.0.1", device: str = "cpu", namespace: str = "pdserve"):
    """Connects every prefill worker to every decode worker for KV transfers; returns the
    KVTransportGroup (its rendezvous store must stay alive while the cluster serves).

    The launcher hosts the TCPStore (master) the transports rendezvous through; every actor gets the
    same frozen `TransportSpec` via `init_transport(spec)` (a decode worker publishes its control
    endpoint there), then every prefill worker forms and warms its channel to every decode worker
    (`connect_transport`: NCCL communicators, IPC mappings, copy kernels), so the first request pays
    none of it and /ready only comes after. Kind: `cfg.kv_transport`, or by default `same_gpu` when
    the actors share one GPU (CUDA IPC, no copy through the host) and `torch_dist` otherwise (NCCL
    between GPUs, gloo on CPU).
    """
    if not prefill:
        return None  # every prompt is prefilled on its decode worker: no transfers at all
    import ray

    from cluster.transport.factory import TransportSpec

    kind = cfg.kv_transport
    if kind is None:
        shared_gpu = device == "cuda" and (cfg.gpus_per_worker or 0) < 1 and gpus_per_actor(
            cfg, ray.cluster_resources().get("GPU", 0.0)) < 1 and len(ray.nodes()) == 1
        kind = "same_gpu" if shared_gpu else "torch_dist"
    store = rendezvous_store(store_host, cfg.kv_store_port)
    spec = TransportSpec(kind, store_host=store_host, store_port=store.port,
                         backend="nccl" if device == "cuda" and kind == "torch_dist" else "gloo", namespace=namespace)
    handles = {**prefill, **decode}
    missing = [wid for wid, h in handles.items() if not hasattr(h, "init_transport")]
    if missing:
        raise PdserveError(f"workers {missing} have no init_transport(spec); run with --prefill-workers 0 "
                           "to prefill on the decode workers")
    group = KVTransportGroup(store, spec)
    try:
        warm = group.join(handles, prefill, decode, cfg.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PdserveError(f"the KV transport group did not form within {cfg.ready_timeout_s:g}s") from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        raise PdserveError(f"forming the KV transport group failed: {str(e).strip().splitlines()[-1]}") from None
    for pid, secs in warm.items():
        log.info("KV channels of %s formed and warmed: %s", pid, {d: round(t, 3) for d, t in secs.items()})
    return group


def rendezvous_store(host: str, port: int = 0):
    """The KV transport group's TCPStore (master), listening on `host` only.

    A TCPStore master given a host still listens on every interface ('::'); so the listening socket
    is made here, bound to the cluster's internal address, and handed over (`master_listen_fd`). A
    wildcard address is refused: the store takes unauthenticated writes."""
    import ipaddress
    import socket

    import torch.distributed as dist

    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = not host
    if wildcard:
        raise PdserveError(f"the KV rendezvous store must listen on the cluster's internal address, not {host!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's event loop owns (and closes) the descriptor now
    return store


def gpus_per_actor(cfg: ClusterConfig, cluster_gpus: float) -> float:
    """1 GPU each when there are enough; an equal share (1/k of one GPU) when actors must share."""
    if cfg.gpus_per_worker is not None:
        return cfg.gpus_per_worker
    if cfg.device == "cpu" or cluster_gpus < 1:
        return 0.0
    n = cfg.prefill_workers + cfg.decode_workers
    if cluster_gpus >= n:
        return 1.0
    return 1.0 / math.ceil(n / int(cluster_gpus))


@dataclass
class _Workers:
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    placement_group: Any = None
    bundle: dict[str, int] = field(default_factory=dict)  # worker id -> its placement-group bundle
    next_index: dict[str, int] = field(default_factory=dict)  # role -> the next worker id's number


class ServingCluster:
    """The running service: Ray actors + router + API-server processes. `start()` then
    `serve_forever()` (the CLI) or `start_in_thread()` (tests, notebooks); `shutdown()` undoes it all."""

    def __init__(self, cfg: ClusterConfig, *, prefill_actor_cls=None, decode_actor_cls=None,
                 form_transport_group: TransportFormer = form_kv_transport_group):
        self.cfg = cfg
        self._prefill_cls = prefill_actor_cls
        self._decode_cls = decode_actor_cls
        self._form_transport_group = form_transport_group
        self.workers = _Workers()
        self.router = None  # router.router.Router, on this process's serving loop
        self.router_server = None  # router.channel.server.RouterServer
        self.api_servers = None  # deploy.api_server.APIServerPool
        self.model_name: str | None = None
        self.url: str | None = None
        self.failure: str | None = None  # why serving stopped on its own (an API server died)
        self.ray_unresponsive = False  # shutdown() gave up waiting for Ray
        self._owns_ray = False
        self._kv_group = None
        self._device = "cpu"
        self.planner = None  # deploy.planner_loop.PlannerLoop with `planner` on
        self.serving_since: float | None = None  # time.time() when the cluster became ready
        self._listen = None
        self._tmp: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._draining = False
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.tag = f"pdserve-{uuid.uuid4().hex[:8]}"  # names this cluster's placement group and actors

    @property
    def _kv_store(self):
        """The KV transport group's rendezvous store (None without prefill workers)."""
        return self._kv_group.store if isinstance(self._kv_group, KVTransportGroup) else self._kv_group

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> "ServingCluster":
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start(self) -> None:
        import ray

        from deploy.api_server import APIServerPool, default_api_servers
        from cluster.model.config import ModelArchConfig
        from router.admission import AdmissionController, AdmissionLimits
        from router.metrics import RouterMetrics
        from router.router import Router, RouterConfig, WorkerClient
        from router.channel.server import RouterServer

        cfg = self.cfg
        model_dir = self._model_dir()
        arch = ModelArchConfig.from_dir(model_dir)
        max_model_len = min(cfg.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        self.model_name = name = cfg.served_model_name or ("pdserve-demo" if cfg.model is None else Path(model_dir).name)
        api_servers = cfg.api_servers or default_api_servers()

        self._init_ray()
        stream_host = cfg.token_stream_host or ("127.0.0.1" if self._local_ray() else ray.util.get_node_ip_address())
        self._tmp = tempfile.mkdtemp(prefix="pdserve-")
        metrics = RouterMetrics(name)
        self.router_server = RouterServer(f"ipc://{self._tmp}/router", stream_host, metrics,
                                          gateways_expected=api_servers, block_size=cfg.block_size)
        self._listen = self._listen_socket()
        metrics_dir = os.path.join(self._tmp, "metrics")
        os.mkdir(metrics_dir)
        self.api_servers = APIServerPool(api_servers, self._listen, dict(
            router_address=self.router_server.address, model_dir=str(model_dir), served_model_name=name,
            max_model_len=max_model_len, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
            token_timeout_s=cfg.token_timeout_s, drain_timeout_s=cfg.drain_timeout_s, sink_host=stream_host,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel())), metrics_dir)
        self.api_servers.start()  # they load the tokenizer while the workers load the model

        self._place_workers(str(model_dir), self.router_server.stats_sink)
        self._kv_group = self._form_transport_group(
            self.workers.prefill, self.workers.decode, cfg, store_host=stream_host, device=self._device,
            namespace=self.tag)
        if cfg.warmup:
            self._warm_up({**self.workers.prefill, **self.workers.decode})

        admission = AdmissionController(AdmissionLimits(
            max_model_len=max_model_len, block_size=cfg.block_size, max_waiting_requests=cfg.max_waiting_requests,
            max_inflight_tokens=cfg.max_inflight_tokens, retry_after_s=cfg.retry_after_s,
            max_prefill_queue_s=cfg.max_prefill_queue_s))
        self.router = Router(
            [WorkerClient(wid, "prefill", h) for wid, h in self.workers.prefill.items()],
            [WorkerClient(wid, "decode", h) for wid, h in self.workers.decode.items()],
            admission,
            RouterConfig(
                prefill_placement=cfg.prefill_placement, itl_cost_weight=cfg.itl_cost_weight,
                local_prefill_threshold=cfg.local_prefill_threshold, stats_interval_s=cfg.stats_interval_s,
                call_timeout_s=cfg.call_timeout_s, prefill_timeout_s=cfg.prefill_timeout_s,
                reserve_wait_s=cfg.reserve_wait_s, migration_wait_s=cfg.migration_wait_s,
                migrate_on_worker_death=cfg.migrate_on_worker_death, workers_restart=cfg.worker_max_restarts != 0,
                prefill_policy=cfg.prefill_policy,
                decode_policy=cfg.decode_policy,
            ),
            metrics,
        )
        self.router.rejoin = self._rejoin_worker
        self.router_server.attach(self.router)
        if cfg.planner:
            from deploy.planner_loop import PlannerLoop

            self.planner = PlannerLoop.for_cluster(self, self.router, metrics)

    def _warm_up(self, handles: dict[str, Any]) -> None:
        """Every worker's warmup(), all at once; returns when all are done (before /ready)."""
        import ray

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

    def _model_dir(self) -> Path:
        if self.cfg.model is None:
            from cluster.model.demo import ensure_demo_model

            return ensure_demo_model()
        p = Path(self.cfg.model).expanduser().resolve()
        if not (p / "config.json").is_file():
            raise PdserveError(f"{p} is not a Hugging Face model directory (no config.json)")
        return p

    def _local_ray(self) -> bool:
        return self.cfg.address is None

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller's Ray (a test, a notebook): use it, and leave it running
        n = self.cfg.prefill_workers + self.cfg.decode_workers
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
        if self._local_ray():
            kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(n * self.cfg.cpus_per_worker))
        try:
            ray.init(address=self.cfg.address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise PdserveError(f"cannot start or join Ray at {self.cfg.address or 'a local instance'}: "
                               f"{str(e).splitlines()[0]}") from None
        self._owns_ray = True

    def _actor_classes(self):
        import ray

        decode_cls, prefill_cls = self._decode_cls, self._prefill_cls
        if decode_cls is None:
            from decode_worker.actor import DecodeWorkerActor as decode_cls
        if prefill_cls is None and self.cfg.prefill_workers:
            from prefill_worker.actor import PrefillWorkerActor as prefill_cls

        def remote(cls):
            return cls if cls is None or hasattr(cls, "options") else ray.remote(cls)
        return remote(prefill_cls), remote(decode_cls)

    def _place_workers(self, model_dir: str, stats_sink: str) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cfg = self.cfg
        prefill_cls, decode_cls = self._actor_classes()
        gpus = gpus_per_actor(cfg, ray.cluster_resources().get("GPU", 0.0))
        self._device = device = "cuda" if gpus > 0 and cfg.device != "cpu" else "cpu"
        if cfg.device == "cuda" and gpus == 0:
            raise PdserveError("device is cuda but the Ray cluster has no GPU")
        wcfg = cfg.worker_config(model_dir, device, gpu_share=gpus if 0 < gpus < 1 else 1.0)
        roles = [("prefill", i) for i in range(cfg.prefill_workers)] + [("decode", i) for i in range(cfg.decode_workers)]
        bundle = {"CPU": cfg.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        extra = {"prefill": dict(cfg.prefill_resources), "decode": dict(cfg.decode_resources)}
        # PACK keeps prefill and decode actors together where they fit (cheaper KV transfers) and
        # spreads them over nodes only when one node can't hold them; custom resources in a role's
        # bundle pin that role to the nodes that offer them.
        pg = placement_group([{**bundle, **extra[role]} for role, _ in roles], strategy="PACK", name=self.tag)
        self.workers.placement_group = pg
        try:
            ray.get(pg.ready(), timeout=cfg.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PdserveError(f"the Ray cluster can't place {len(roles)} workers with {bundle} each "
                               f"(plus {extra['prefill'] or {}} for prefill, {extra['decode'] or {}} for decode) "
                               f"(available: {ray.available_resources()})") from None
        self._actor_args = (prefill_cls, decode_cls, wcfg, gpus, extra, stats_sink)
        for k, (role, i) in enumerate(roles):
            self._create_actor(role, f"{role}-{i}", k)
        self.workers.next_index = {"prefill": cfg.prefill_workers, "decode": cfg.decode_workers}
        handles = {**self.workers.prefill, **self.workers.decode}
        log.info("waiting for %d workers to load %s on %s", len(handles), model_dir, device)
        refs = {wid: h.stats.remote() for wid, h in handles.items()}
        try:
            ray.get(list(refs.values()), timeout=cfg.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PdserveError(f"workers did not start within {cfg.ready_timeout_s:g}s") from None
        except ray.exceptions.RayActorError as e:
            cause = str(e).strip().splitlines()
            raise PdserveError(f"a worker failed to start: {cause[-1] if cause else e}") from None

    def _create_actor(self, role: str, wid: str, bundle_index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        prefill_cls, decode_cls, wcfg, gpus, extra, stats_sink = self._actor_args
        opts = dict(num_cpus=self.cfg.cpus_per_worker, num_gpus=gpus, name=f"{self.tag}-{wid}",
                    resources=extra[role] or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.workers.placement_group,
                                                                         placement_group_bundle_index=bundle_index),
                    # A restarted actor reruns __init__ (a new incarnation) and rejoins through the
                    # router's rejoin hook (_rejoin_worker); no call is retried: the router moves
                    # what a dead worker held.
                    max_restarts=self.cfg.worker_max_restarts, max_task_retries=0)
        if role == "prefill":
            h = self.workers.prefill[wid] = prefill_cls.options(**opts).remote(wid, wcfg)
        else:
            h = self.workers.decode[wid] = decode_cls.options(**opts).remote(wid, wcfg, stats_sink)
        self.workers.bundle[wid] = bundle_index
        return h

    # -- role switches (the P:D planner) ----------------------------------------------------------
    def retire_worker(self, worker_id: str) -> int:
        """Shuts a worker's actor down and frees its GPU (the router must have let go of it first);
        returns its placement-group bundle, for the worker that takes its place. Blocking."""
        import ray

        h = self.workers.prefill.pop(worker_id, None) or self.workers.decode.pop(worker_id)
        try:
            ray.get(h.shutdown.remote(), timeout=10)
        except Exception:
            pass  # it may already be gone; the kill below frees its resources anyway
        ray.kill(h)
        return self.workers.bundle.pop(worker_id)

    def spawn_worker(self, role: str, bundle_index: int) -> tuple[str, Any]:
        """Starts a worker of `role` in a bundle (a GPU) a retired worker left, joins it to the KV
        transport group and warms it up; returns (its new id, its handle) once it can serve. New ids
        only: transfer pairs and their sequence numbers are per pair of ids. Blocking."""
        import ray

        if role == "prefill" and self._actor_args[0] is None:
            from prefill_worker.actor import PrefillWorkerActor

            self._actor_args = (ray.remote(PrefillWorkerActor), *self._actor_args[1:])
        wid = f"{role}-{self.workers.next_index[role]}"
        self.workers.next_index[role] += 1
        h = self._create_actor(role, wid, bundle_index)
        try:
            ray.get(h.stats.remote(), timeout=self.cfg.ready_timeout_s)  # loaded (the old one is gone by now)
            if isinstance(self._kv_group, KVTransportGroup):
                self._kv_group.join({wid: h}, self.workers.prefill, self.workers.decode, self.cfg.ready_timeout_s)
            if self.cfg.warmup:
                self._warm_up({wid: h})
        except BaseException:
            self.retire_worker(wid)
            raise
        return wid, h

    # -- restarts --------------------------------------------------------------------------------
    async def _rejoin_worker(self, worker_id: str, role: str, peers: list[str]) -> None:
        """The router's rejoin hook: Ray restarted the worker's actor (a new incarnation, no transport
        yet). Joins it to the KV transport group with the healthy workers of the other role, `peers`
        (a prefill worker forms its pairs to them; each of them forms its pair to a decode worker:
        the pair of its old incarnation is re-formed), then warms it up. A peer restarting meanwhile
        forms the pair when it rejoins itself (or on its first transfer)."""
        await asyncio.get_running_loop().run_in_executor(None, self._rejoin_blocking, worker_id, role, peers)

    def _rejoin_blocking(self, worker_id: str, role: str, peers: list[str]) -> None:
        h = (self.workers.prefill if role == "prefill" else self.workers.decode)[worker_id]
        if isinstance(self._kv_group, KVTransportGroup):
            if role == "prefill":
                prefill, decode = {worker_id: h}, {d: self.workers.decode[d] for d in peers}
            else:
                prefill, decode = {p: self.workers.prefill[p] for p in peers}, {worker_id: h}
            self._kv_group.join({worker_id: h}, prefill, decode, self.cfg.ready_timeout_s)
        if self.cfg.warmup:
            self._warm_up({worker_id: h})

    # -- serving ---------------------------------------------------------------------------------
    def _listen_socket(self):
        """The gateway's socket, bound here: a port in use is a one-line error, not uvicorn's exit."""
        import socket

        host, port = self.cfg.host, self.cfg.port
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            # Connections queue here from now on; the API-server processes accept from this socket.
            sock.listen(2048)
        except OSError as e:
            sock.close()
            raise PdserveError(f"the HTTP server cannot listen on {host}:{port}: {e.strerror}") from None
        return sock

    def _bound_url(self) -> str:
        host, port = self._listen.getsockname()[:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{shown}:{port}"

    async def _serve(self, announce: bool) -> None:
        """Runs the router until stopped (shutdown(), SIGTERM's drain, or an API server dying)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        rs = self.router_server
        await rs.start()
        watcher = self._loop.create_task(self._watch_api_servers(), name="api-server-watch")
        planner = None
        try:
            deadline = time.monotonic() + self.cfg.ready_timeout_s
            while not rs.ready and not self._stop.is_set():
                if time.monotonic() > deadline:
                    raise PdserveError(f"the API servers and the router were not ready within "
                                       f"{self.cfg.ready_timeout_s:g}s ({rs.gateways_up} of "
                                       f"{self.api_servers.count} API servers up)")
                await asyncio.sleep(0.05)
            if not self._stop.is_set():
                self.url = self._bound_url()
                self.serving_since = time.time()
                if announce:
                    print(f"pdserve: serving {self.model_name} at {self.url}/v1 ({len(self.workers.prefill)} prefill, "
                          f"{len(self.workers.decode)} decode workers, {self.api_servers.count} API servers)",
                          flush=True)
                if self.planner is not None:  # on the router's loop, beside the router
                    planner = self._loop.create_task(self.planner.run(), name="pd-planner")
            await self._stop.wait()
        finally:
            watcher.cancel()
            if planner is not None:
                planner.cancel()
                await asyncio.gather(planner, return_exceptions=True)
            # The API servers first: each ends its streams with an error event and [DONE] (a stop
            # during a drain); the router's stop would end them with "abort" under their feet.
            await asyncio.get_running_loop().run_in_executor(None, self.api_servers.stop)
            await rs.stop()

    async def _watch_api_servers(self) -> None:
        """An API server that dies on its own takes its clients with it (the router aborts its
        requests); the others drain and the launcher stops, so that a supervisor restarts it whole."""
        while True:
            await asyncio.sleep(0.5)
            dead = self.api_servers.exited()
            if dead and not self._draining and not self._stopped:
                self.failure = f"API server {dead[0][0]} exited with code {dead[0][1]}"
                log.error("%s; draining the others and stopping", self.failure)
                self._loop.create_task(self._drain_then_stop(), name="drain")
                return

    def request_drain(self) -> bool:
        """SIGTERM (from any thread): drain once; False if a drain already runs."""
        if self._loop is None or self._draining:
            return False
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_stop(), name="drain"))
        return True

    async def _drain_then_stop(self) -> None:
        if self._draining:
            return
        self._draining = True
        timeout = self.cfg.drain_timeout_s
        log.info("draining %d in-flight requests (up to %gs)", len(self.router.inflight), timeout)
        await self.router_server.drain(timeout)
        # Each API server finishes its requests (or ends them at the timeout), then exits.
        deadline = time.monotonic() + timeout + 15
        while self.api_servers.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stop.set()

    def serve_forever(self) -> None:
        """The CLI: blocks until Ctrl-C or SIGTERM (which drains first), then shuts everything down."""
        previous = signal.getsignal(signal.SIGTERM)

        async def main():
            loop = asyncio.get_running_loop()
            # Installed after ray.init, which sets its own SIGTERM handler (sys.exit(15)) in the driver.
            # A second SIGTERM stops at once.
            loop.add_signal_handler(signal.SIGTERM, lambda: self.request_drain() or self._stop_now())
            await self._serve(announce=True)
        try:
            self.start()
            asyncio.run(main())
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()
            signal.signal(signal.SIGTERM, previous)
        if self.ray_unresponsive:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if self.failure else 0)  # not through Ray's atexit hook (see shutdown)
        if self.failure:
            raise PdserveError(self.failure)

    def _stop_now(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def start_in_thread(self, timeout_s: float = 120.0) -> str:
        """Serves from a background thread; returns the base URL once everything is ready."""
        if self.router is None:
            self.start()
        errors: list[BaseException] = []

        def run():
            try:
                asyncio.run(self._serve(announce=False))
            except BaseException as e:  # noqa: BLE001 (reported to the caller below)
                errors.append(e)
        self._thread = threading.Thread(target=run, name="pdserve-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.url is None:
            if errors or not self._thread.is_alive():
                self.shutdown()
                raise PdserveError(f"the cluster did not start: {errors[0] if errors else 'thread exited'}")
            if time.monotonic() > deadline:
                self.shutdown()
                raise PdserveError("the cluster did not start in time")
            time.sleep(0.02)
        return self.url

    def call(self, fn, timeout_s: float = 10.0):
        """Runs `fn()` on the router's loop (where the router's state lives) and returns its result."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    # -- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.api_servers is not None:
            self.api_servers.stop()
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop_now)
            self._thread.join(timeout=15)
        if self._listen is not None:
            self._listen.close()
        # A local Ray whose GCS died first gets no budget at all: nothing it could do would answer.
        budget = 0.0 if self._owns_ray and self._local_ray() and _gcs_gone() else _RAY_STOP_BUDGET_S
        if not self._stop_ray(budget):
            # Ray's control plane is gone or hung (its GCS was killed first, say): every Ray call would
            # wait for it (~60 s "Failed to connect to GCS"). What this process started of Ray goes
            # with it; the exit skips Ray's own atexit hook, which would wait the same way.
            log.error("Ray did not answer within %gs while stopping; not waiting for it", budget)
            self.ray_unresponsive = True
            if self._owns_ray:
                _kill_children()
        if self.router_server is not None:
            self.router_server.close()  # closed already if it served
        self._kv_group = None  # after the workers: they may still talk to it while shutting down
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        print("pdserve: stopped", file=sys.stderr, flush=True)

    def _stop_ray(self, budget_s: float) -> bool:
        """Stops the workers and (if this process started it) Ray, on a thread; False if that took
        longer than `budget_s` (it goes on in the background)."""
        done = threading.Event()

        def run():
            try:
                self._stop_ray_now()
            except Exception:  # noqa: BLE001 - stopping anyway
                log.exception("stopping the Ray actors failed")
            finally:
                done.set()
        threading.Thread(target=run, name="ray-stop", daemon=True).start()
        return done.wait(budget_s)

    def _stop_ray_now(self) -> None:
        try:
            import ray
        except ImportError:  # pragma: no cover
            return
        if ray.is_initialized():
            handles = [*self.workers.prefill.values(), *self.workers.decode.values()]
            refs = [h.shutdown.remote() for h in handles]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=_RAY_STOP_BUDGET_S / 3)
            except Exception:
                pass
            for h in handles:
                try:
                    ray.kill(h)
                except Exception:
                    pass
            if self.workers.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.workers.placement_group)
                except Exception:
                    pass
            if self._owns_ray:
                ray.shutdown()
