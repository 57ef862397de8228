"""`pdserve serve`: starts (or joins) Ray, places the workers, forms the KV transfer group, and runs
the router and the OpenAI-compatible gateway.

Start-up order matters: the gateway's token-stream socket is bound first (decode workers are
created with its address), then the actors are placed and load the model, then the transport group
is formed, and only then does the HTTP server start accepting, so /ready never lies.

The gateway and router run in this (the launcher's) process, on uvicorn's event loop, not in a Ray
actor: the token stream is received on the same loop that writes the HTTP responses (no extra hop,
no Ray call per token), the process that owns the workers also owns the port (Ctrl-C / SIGTERM here
stop everything in order, nothing is orphaned), and the gateway needs no GPU. Scaling the HTTP side
out (several gateways) is a matter of running more launchers' gateways against the same actors;
it is not needed at the rates one decode fleet produces.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.app.config import ClusterConfig, add_config_flags, overrides_from_args
from cluster.errors import PdserveError

log = logging.getLogger("pdserve.launch")

# (prefill handles by id, decode handles by id, cluster config, **where) -> whatever must stay alive
# while serving (the rendezvous store); forms the KV transport group.
TransportFormer = Callable[..., Any]


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
    """Connects every prefill worker to every decode worker for KV transfers; returns the rendezvous
    store, which the caller must keep alive while the cluster serves.

    The launcher hosts the TCPStore (master) the transports rendezvous through; every actor gets the
    same frozen `TransportSpec` via `init_transport(spec)`, which returns at once (pairs connect at
    their first transfer). Kind: `cfg.kv_transport`, or by default `same_gpu` when the actors share
    one GPU (CUDA IPC, no copy through the host) and `torch_dist` otherwise (NCCL between GPUs,
    gloo on CPU).
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
    try:
        ray.get([h.init_transport.remote(spec) for h in handles.values()], timeout=cfg.ready_timeout_s)
    except ray.exceptions.RayActorError as e:
        raise PdserveError(f"forming the KV transport group failed: {str(e).strip().splitlines()[-1]}") from None
    return store


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


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so that the shutdown below runs (then exit 0)."""


@dataclass
class _Workers:
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    placement_group: Any = None


class ServingCluster:
    """The running service: Ray actors + router + gateway. `start()` then `serve_forever()` (the CLI)
    or `start_in_thread()` (tests, notebooks); `shutdown()` undoes all of it."""

    def __init__(self, cfg: ClusterConfig, *, prefill_actor_cls=None, decode_actor_cls=None,
                 form_transport_group: TransportFormer = form_kv_transport_group):
        self.cfg = cfg
        self._prefill_cls = prefill_actor_cls
        self._decode_cls = decode_actor_cls
        self._form_transport_group = form_transport_group
        self.workers = _Workers()
        self.app = None
        self.url: str | None = None
        self._owns_ray = False
        self._token_stream = None
        self._kv_store = None
        self._device = "cpu"
        self._server = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.tag = f"pdserve-{uuid.uuid4().hex[:8]}"  # names this cluster's placement group and actors

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

        from cluster.model.config import ModelArchConfig
        from cluster.tokenizer import load_tokenizer
        from router.admission import AdmissionController, AdmissionLimits
        from router.gateway import Gateway, GatewayConfig, build_app
        from router.metrics import ServingMetrics
        from router.router import Router, RouterConfig, WorkerClient
        from router.token_stream import TokenStreamReceiver

        cfg = self.cfg
        model_dir = self._model_dir()
        arch = ModelArchConfig.from_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        max_model_len = min(cfg.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        name = cfg.served_model_name or ("pdserve-demo" if cfg.model is None else Path(model_dir).name)

        self._init_ray()
        stream_host = cfg.token_stream_host or ("127.0.0.1" if self._local_ray() else ray.util.get_node_ip_address())
        self._token_stream = TokenStreamReceiver(stream_host)
        self._place_workers(str(model_dir), self._token_stream.address)
        self._kv_store = self._form_transport_group(
            self.workers.prefill, self.workers.decode, cfg, store_host=stream_host, device=self._device,
            namespace=self.tag)

        metrics = ServingMetrics(name)
        admission = AdmissionController(AdmissionLimits(
            max_model_len=max_model_len, block_size=cfg.block_size, max_waiting_requests=cfg.max_waiting_requests,
            max_inflight_tokens=cfg.max_inflight_tokens, retry_after_s=cfg.retry_after_s))
        router = Router(
            [WorkerClient(wid, "prefill", h) for wid, h in self.workers.prefill.items()],
            [WorkerClient(wid, "decode", h) for wid, h in self.workers.decode.items()],
            self._token_stream, admission,
            RouterConfig(
                local_prefill_threshold=cfg.local_prefill_threshold, stats_interval_s=cfg.stats_interval_s,
                call_timeout_s=cfg.call_timeout_s, prefill_timeout_s=cfg.prefill_timeout_s,
                reserve_wait_s=cfg.reserve_wait_s, migrate_on_worker_death=cfg.migrate_on_worker_death,
                prefill_policy=cfg.prefill_policy,
                decode_policy=cfg.decode_policy,
            ),
            metrics,
        )
        gw = Gateway(GatewayConfig(model_name=name, max_model_len=max_model_len, api_key=cfg.api_key,
                                   max_body_bytes=cfg.max_body_bytes, token_timeout_s=cfg.token_timeout_s),
                     tokenizer, router, self._token_stream, metrics)
        self.gateway = gw
        self.app = build_app(gw)

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

    def _place_workers(self, model_dir: str, token_sink: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
        for k, (role, i) in enumerate(roles):
            wid = f"{role}-{i}"
            opts = dict(num_cpus=cfg.cpus_per_worker, num_gpus=gpus, name=f"{self.tag}-{wid}",
                        resources=extra[role] or None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k))
            if role == "prefill":
                self.workers.prefill[wid] = prefill_cls.options(**opts).remote(wid, wcfg)
            else:
                self.workers.decode[wid] = decode_cls.options(**opts).remote(wid, wcfg, token_sink)
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

    # -- serving ----------------------------------------------------------------------------------
    def _uvicorn_server(self):
        import uvicorn

        cluster = self

        class DrainingServer(uvicorn.Server):
            """uvicorn, except that the first SIGTERM drains (cluster.drain) before the server stops."""

            def handle_exit(self, sig, frame):
                if sig == signal.SIGTERM and not self.should_exit and cluster._begin_drain(self):
                    self._captured_signals.append(sig)  # re-raised once the server stopped: shutdown runs
                    return
                super().handle_exit(sig, frame)

        config = uvicorn.Config(self.app, host=self.cfg.host, port=self.cfg.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5, access_log=False)
        return DrainingServer(config)

    def _begin_drain(self, server) -> bool:
        """From the SIGTERM handler (the loop's thread): starts the drain once; False if it already
        runs (a second SIGTERM then stops the server at once)."""
        gw = getattr(self, "gateway", None)
        loop = gw.loop if gw is not None else None
        if loop is None or gw.draining:
            return False
        gw.draining = True  # /ready false and 503 from here on, before the loop even wakes up

        async def drain_then_exit():
            log.info("SIGTERM: draining %d in-flight requests (up to %gs)", len(gw.router.inflight),
                     self.cfg.drain_timeout_s)
            left = await gw.drain(self.cfg.drain_timeout_s)
            if left:
                log.warning("drain timeout: aborting %d requests still in flight", left)
            server.should_exit = True
        loop.call_soon_threadsafe(lambda: loop.create_task(drain_then_exit(), name="drain"))
        return True

    def _bound_url(self) -> str:
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{shown}:{port}"

    def _listen_socket(self):
        """The gateway's socket, bound here: a port in use is a one-line error, not uvicorn's exit."""
        import socket

        host, port = self.cfg.host, self.cfg.port
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise PdserveError(f"the HTTP server cannot listen on {host}:{port}: {e.strerror}") from None
        return sock

    async def _serve(self, announce: bool) -> None:
        self._server = server = self._uvicorn_server()
        task = asyncio.ensure_future(server.serve(sockets=[self._listen_socket()]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            self.url = self._bound_url()
            if announce:
                print(f"pdserve: serving {self.gateway.cfg.model_name} at {self.url}/v1 "
                      f"({len(self.workers.prefill)} prefill, {len(self.workers.decode)} decode workers)", flush=True)
        await task
        if not server.started:
            raise PdserveError(f"the HTTP server could not start on {self.cfg.host}:{self.cfg.port}")

    def serve_forever(self) -> None:
        """The CLI: blocks until Ctrl-C or SIGTERM, then shuts everything down."""
        # uvicorn handles SIGINT/SIGTERM while it runs (SIGTERM drains first: DrainingServer), then re-raises the signal
        # into the previous handler: SIGTERM must become an exception here, not a silent exit that
        # would orphan the actors.
        def on_sigterm(signum, frame):
            raise _Terminated()
        previous = signal.getsignal(signal.SIGTERM)
        try:
            self.start()  # a SIGTERM in here still shuts down (start() cleans up on any exception)
            # Installed after ray.init, which sets its own SIGTERM handler (sys.exit(15)) in the driver.
            signal.signal(signal.SIGTERM, on_sigterm)
            asyncio.run(self._serve(announce=True))
        except (KeyboardInterrupt, _Terminated):
            pass
        finally:
            self.shutdown()
            signal.signal(signal.SIGTERM, previous)

    def start_in_thread(self, timeout_s: float = 60.0) -> str:
        """Serves from a background thread; returns the base URL once the server accepts."""
        if self.app is None:
            self.start()
        errors: list[BaseException] = []

        def run():
            try:
                asyncio.run(self._serve(announce=False))
            except BaseException as e:  # noqa: BLE001 (reported to the caller below)
                errors.append(e)
        self._thread = threading.Thread(target=run, name="pdserve-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.url is None:
            if errors or not self._thread.is_alive():
                self.shutdown()
                raise PdserveError(f"the gateway did not start: {errors[0] if errors else 'thread exited'}")
            if time.monotonic() > deadline:
                self.shutdown()
                raise PdserveError("the gateway did not start in time")
            time.sleep(0.02)
        return self.url

    # -- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        try:
            import ray
        except ImportError:  # pragma: no cover
            return
        if ray.is_initialized():
            handles = [*self.workers.prefill.values(), *self.workers.decode.values()]
            refs = [h.shutdown.remote() for h in handles]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=10)
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
        if self._token_stream is not None:
            self._token_stream.close()
        self._kv_store = None  # after the workers: they may still talk to it while shutting down
        print("pdserve: stopped", file=sys.stderr, flush=True)
