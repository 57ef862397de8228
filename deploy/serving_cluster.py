"""ServingCluster: what `pdserve serve` runs. It starts (or joins) Ray, places the workers, forms the KV
transfer group, runs the router, and starts the API-server processes that serve the OpenAI-compatible
HTTP API.

Processes:
- this one, the launcher: the Ray driver, and the one Router (admission, placement, migration) on
  its asyncio loop, served to the gateways by a RouterServer (router/channel/server.py), which also
  collects the decode workers' step records for /stats and /metrics;
- `api_servers` gateway processes (deploy/api_server.py) sharing one listening socket, each
  with its own token sink: decode workers send each of them only its own requests' text;
- the Ray actors (prefill and decode workers: deploy/ray_workers.py).

Start-up order: the router's sockets and the HTTP socket are bound first (a port in use is a one-line
error before anything starts; the gateway processes start importing while the workers load), then
the actors are placed (decode workers get the router's step-record sink) and the transport group is
formed (deploy/kv_transport_group.py), then every worker warms up (`warmup()`: prefill shapes, the
local-prefill path, a decode step per graph variant; the first request then costs what the hundredth
does); /ready turns true only when the router has polled every worker and every gateway process is
up. Each component's config comes from the one ClusterConfig (deploy/component_configs.py).

SIGTERM drains: the router refuses new requests, every gateway lets its in-flight requests finish
(up to `drain_timeout_s`), then everything stops in order and the launcher exits 0. Stopping never
waits on a Ray that stopped answering (deploy/ray_runtime.py).

With `planner` on, a PlannerLoop (deploy/planner_loop.py) runs beside the router and moves
workers between prefill and decode on the GPUs they hold (`spawn_worker` / `retire_worker` here).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import ray

from cluster.errors import PdserveError
from cluster.process.process_template import ProcessTemplate
from cluster.transport.store_process import PRELOAD as STORE_PRELOAD
from cluster.wire.frame_auth import new_cluster_secret
from cluster.kv.request_limits import served_max_model_len
from cluster.worker.startup_heap import freeze_startup_heap
from deploy.api_server import PRELOAD as API_SERVER_PRELOAD
from deploy.api_server import APIServerPool, default_api_servers
from deploy.component_configs import admission_limits, api_server_settings, cache_config_info, router_config
from deploy.config import ClusterConfig
from deploy.kv_transport_group import KVTransportGroup, TransportFormer, form_kv_transport_group, start_kv_store
from deploy.planner_loop import PlannerLoop
from deploy.preflight import ServedModel, check_model
from deploy.ray_runtime import RAY_STOP_BUDGET_S, gcs_gone, init_ray, kill_children, run_within
from deploy.ray_workers import RayWorkers
from router.requests.admission import AdmissionController
from router.stats.arrival_stats import ArrivalStats
from router.stats.metrics import RouterMetrics
from router.router import Router, WorkerClient
from router.channel.server import RouterServer
from router.workers.prefill_answers import PrefillAnswers

log = logging.getLogger("pdserve.launch")


class ServingCluster:
    """The running service: Ray actors + router + API-server processes. `start()` then
    `serve_forever()` (the CLI) or `start_in_thread()` (tests, notebooks); `shutdown()` undoes it all."""

    def __init__(self, cfg: ClusterConfig, *, prefill_actor_cls=None, decode_actor_cls=None,
                 form_transport_group: TransportFormer = form_kv_transport_group):
        self.cfg = cfg
        self.tag = f"pdserve-{uuid.uuid4().hex[:8]}"  # names this cluster's placement group and actors
        self._form_transport_group = form_transport_group
        self.workers = RayWorkers(cfg, self.tag, prefill_actor_cls=prefill_actor_cls,
                                  decode_actor_cls=decode_actor_cls)
        self.router: Router | None = None  # on this process's serving loop
        self.router_server: RouterServer | None = None
        self.prefill_answers: PrefillAnswers | None = None  # the router's answer socket (prefill_dispatch "zmq")
        self.api_servers: APIServerPool | None = None
        self.model_name: str | None = None
        self.served: ServedModel | None = None  # check(): what it serves, checked before anything starts
        self.url: str | None = None
        self.failure: str | None = None  # why serving stopped on its own (an API server died)
        self.ray_unresponsive = False  # shutdown() gave up waiting for Ray
        self._owns_ray = False
        self.planner: PlannerLoop | None = None  # with `planner` on
        self.serving_since: float | None = None  # time.time() when the cluster became ready
        self._listen: socket.socket | None = None
        self._tmp: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._draining = False
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._early_store = None  # the KV rendezvous store's process, started before the workers

    @property
    def _kv_store(self):
        """The KV transport group's rendezvous store's process (StoreProcess; None without prefill
        workers, or with a test's own transport former)."""
        g = self.workers.kv_group
        return g.store if isinstance(g, KVTransportGroup) else self._early_store

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> "ServingCluster":
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def check(self) -> ServedModel:
        """The checks before anything starts (deploy/preflight.py); start() runs them if not yet done."""
        if self.served is None:
            self.served = check_model(self.cfg)
        return self.served

    def _start(self) -> None:
        cfg = self.cfg
        served = self.check()
        model_dir = served.model_dir
        max_model_len = served_max_model_len(cfg.max_model_len, served.arch.max_position_embeddings)
        self.model_name = name = served.name
        api_servers = cfg.api_servers or default_api_servers()

        # The API servers' and the store's processes are forked from this process's template, which
        # imports their libraries (seconds) while Ray starts and the workers load the model.
        template = ProcessTemplate.shared(API_SERVER_PRELOAD + STORE_PRELOAD)
        self._owns_ray = init_ray(cfg)
        # The cluster's internal sockets (token streams, stats sink, KV control and payload) bind the
        # loopback when the whole cluster is this one node: nothing else on the network reaches them.
        stream_host = cfg.token_stream_host or ("127.0.0.1" if self._one_node() else ray.util.get_node_ip_address())
        # Their frames carry a MAC under this secret (cluster/wire/frame_auth.py), drawn anew for each
        # start and handed to every process of the cluster: the workers through Ray, the API servers
        # on their stdin.
        secret = new_cluster_secret()
        if cfg.prefill_workers and self._form_transport_group is form_kv_transport_group:
            # The store's process starts while the API servers and the workers do; forming the
            # transport group waits for it. (A test's own former starts its own.)
            self._early_store = start_kv_store(cfg, stream_host, secret, self.tag, template)
        self._tmp = tempfile.mkdtemp(prefix="pdserve-")
        metrics = RouterMetrics(name, cache_config=cache_config_info(cfg), precision=served.precision())
        self.router_server = RouterServer(f"ipc://{self._tmp}/router", stream_host, metrics,
                                          gateways_expected=api_servers, block_size=cfg.block_size, secret=secret)
        self._listen = self._listen_socket()
        for warning in cfg.security_warnings():
            log.warning("%s", warning)
        metrics_dir = os.path.join(self._tmp, "metrics")
        os.mkdir(metrics_dir)
        self.api_servers = APIServerPool(api_servers, self._listen, api_server_settings(
            cfg, router_address=self.router_server.address, model_dir=str(model_dir), served_model_name=name,
            max_model_len=max_model_len, sink_host=stream_host,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            chat_template=served.chat_template, sampling_defaults=served.sampling_defaults.as_dict(),
            cluster_secret=secret, precision=served.precision()), metrics_dir, template)
        self.api_servers.start()  # they load the tokenizer while the workers load the model

        workers = self.workers
        workers.place(str(model_dir), self.router_server.stats_sink, secret)
        workers.kv_group = self._form_transport_group(workers.prefill, workers.decode, cfg, store_host=stream_host,
                                                      device=workers.device, namespace=self.tag, secret=secret,
                                                      store=self._early_store)
        if cfg.warmup:
            workers.warm_up(workers.handles)

        # Prompts go to prefill workers as signed frames and their answers come back as frames to the
        # router's answer socket (cfg.prefill_dispatch "zmq"), else both as one Ray call.
        if cfg.prefill_dispatch == "zmq":
            self.prefill_answers = PrefillAnswers(stream_host, secret,
                                                  on_rejected=lambda: metrics.frame_rejected("prefill_answer"))
        self.router = Router(
            [self.worker_client(wid, "prefill", h) for wid, h in workers.prefill.items()],
            [self.worker_client(wid, "decode", h) for wid, h in workers.decode.items()],
            AdmissionController(admission_limits(cfg, max_model_len)),
            router_config(cfg),
            metrics,
            # The P:D planner reads the request mix over its own window.
            arrivals=ArrivalStats(window_s=cfg.planner_window_s) if cfg.planner else None,
        )
        self.router.rejoin = workers.rejoin
        self.router.gone_check = workers.gone
        self.router_server.attach(self.router)
        if cfg.planner:
            self.planner = PlannerLoop.for_cluster(self, self.router, metrics)

    def worker_client(self, worker_id: str, role: str, handle) -> WorkerClient:
        """The router's client of a worker of this cluster (also one a role switch starts)."""
        return WorkerClient(worker_id, role, handle, answers=self.prefill_answers)

    def _local_ray(self) -> bool:
        return self.cfg.address is None

    def _one_node(self) -> bool:
        """The cluster is this node alone: a local Ray, or a joined Ray cluster with one node alive.
        (A node that joins later cannot reach loopback sockets: give such a cluster token_stream_host.)"""
        return self._local_ray() or sum(1 for n in ray.nodes() if n.get("Alive")) == 1

    # -- role switches (the P:D planner's RoleSwitcher calls these) -------------------------------
    def retire_worker(self, worker_id: str) -> int:
        """Shuts a worker down and frees its GPU; returns its placement-group bundle (RayWorkers.retire)."""
        return self.workers.retire(worker_id)

    def spawn_worker(self, role: str, bundle_index: int) -> tuple[str, Any]:
        """Starts, joins and warms a worker of `role` in that bundle; returns (id, handle) (RayWorkers.spawn)."""
        return self.workers.spawn(role, bundle_index)

    # -- serving ---------------------------------------------------------------------------------
    def _listen_socket(self) -> socket.socket:
        """The gateway's socket, bound here: a port in use is a one-line error, not uvicorn's exit."""
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

    async def _serve(self, own_process: bool) -> None:
        """Runs the router until stopped (shutdown(), SIGTERM's drain, or an API server dying).
        own_process: `pdserve serve`'s run, whose process is pdserve's alone: it prints the serving
        line and, once serving, freezes its startup heap (an embedding process's heap is left alone)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        rs = self.router_server
        await rs.start()
        watcher = self._loop.create_task(self._watch_children(), name="child-watch")
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
                if own_process:
                    # Before the serving line, which clients wait for: the freeze pauses the router's loop
                    # for one full collection (cluster/worker/startup_heap.py).
                    log.info("the launcher's startup heap frozen: %s", freeze_startup_heap())
                    p = self.served.precision()
                    print(f"pdserve: serving {self.model_name} at {self.url}/v1 ({len(self.workers.prefill)} prefill, "
                          f"{len(self.workers.decode)} decode workers, {self.api_servers.count} API servers; "
                          f"dtype {p['dtype']}, quantization {p['quantization']}, KV cache {p['kv_cache_dtype']})",
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
            if self.prefill_answers is not None:
                self.prefill_answers.close()  # (on its loop: it cancels the lifelines' tasks)

    async def _watch_children(self) -> None:
        """An API server that dies on its own takes its clients with it (the router aborts its
        requests); the others drain and the launcher stops, so that a supervisor restarts it whole.
        The same for the KV rendezvous store's process."""
        while True:
            await asyncio.sleep(0.5)
            if self._draining or self._stopped:
                continue
            dead = self.api_servers.exited()
            if dead:
                self.failure = f"API server {dead[0][0]} exited with code {dead[0][1]}"
                log.error("%s; draining the others and stopping", self.failure)
                self._loop.create_task(self._drain_then_stop(), name="drain")
                return
            store = self._kv_store
            code = store.exited() if store is not None else None
            if code is not None:
                # No new pair can form and no transfer can be claimed without it, and the workers'
                # heartbeats stop: the launcher drains and stops, so a supervisor restarts it whole.
                # (During the drain a request prefilled on its decode worker needs no store; a
                # transfer's claim fails without it. Only the stop itself is tested.)
                self.failure = f"the KV rendezvous store's process exited with code {code}"
                log.error("%s; draining and stopping", self.failure)
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

    def serve_forever(self) -> int:
        """The CLI: blocks until Ctrl-C or SIGTERM (which drains first), then shuts everything down.
        Returns the exit code. A check that fails before anything started (check()) raises its
        PdserveError (the CLI prints it); an error after that is printed here as `error: ...`,
        before the `pdserve: stopped` line that ends every run that started something."""
        self.check()
        previous = signal.getsignal(signal.SIGTERM)
        error: PdserveError | None = None

        async def main():
            loop = asyncio.get_running_loop()
            # Installed after ray.init, which sets its own SIGTERM handler (sys.exit(15)) in the driver.
            # A second SIGTERM stops at once.
            loop.add_signal_handler(signal.SIGTERM, lambda: self.request_drain() or self._stop_now())
            await self._serve(own_process=True)
        try:
            self.start()
            asyncio.run(main())
        except KeyboardInterrupt:
            pass
        except PdserveError as e:
            error = e
        finally:
            self.shutdown()
            signal.signal(signal.SIGTERM, previous)
        if error is None and self.failure:
            error = PdserveError(self.failure)
        if error is not None:
            print(f"error: {error}", file=sys.stderr, flush=True)
        print("pdserve: stopped", file=sys.stderr, flush=True)
        code = 2 if error is not None else 0
        if self.ray_unresponsive:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # not through Ray's atexit hook (see shutdown)
        return code

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
                asyncio.run(self._serve(own_process=False))
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

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0):
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
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            # (a serving thread that stopped on its own, e.g. a dead child, has closed its loop)
            self._loop.call_soon_threadsafe(self._stop_now)
            self._thread.join(timeout=15)
        if self._listen is not None:
            self._listen.close()
        # A local Ray whose GCS died first gets no budget at all: nothing it could do would answer.
        budget = 0.0 if self._owns_ray and self._local_ray() and gcs_gone() else RAY_STOP_BUDGET_S
        if not run_within(self._stop_ray_now, budget, "stopping the Ray actors"):
            # Ray's control plane is gone or hung (its GCS was killed first, say): every Ray call would
            # wait for it (~60 s "Failed to connect to GCS"). What this process started of Ray goes
            # with it; the exit skips Ray's own atexit hook, which would wait the same way.
            log.error("Ray did not answer within %gs while stopping; not waiting for it", budget)
            self.ray_unresponsive = True
            if self._owns_ray:
                kill_children()
        if self.router_server is not None:
            self.router_server.close()  # closed already if it served
        if self.prefill_answers is not None:
            self.prefill_answers.close()  # (the same)
        # The store's process after the workers: they may still talk to it while shutting down.
        if isinstance(self.workers.kv_group, KVTransportGroup):
            self.workers.kv_group.close()
        if self._early_store is not None:
            self._early_store.stop()
        self.workers.kv_group = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _stop_ray_now(self) -> None:
        """The workers, then (if this process started it) Ray itself."""
        if ray.is_initialized():
            self.workers.stop()
            if self._owns_ray:
                ray.shutdown()
