"""The KV transport group of a serving cluster: every prefill worker connected to every decode worker
for KV transfers, formed before /ready, joined by every worker that starts later (a role switch, a
Ray restart).

The launcher hosts the TCPStore (master) the transports rendezvous through in a child process
(`start_kv_store`: cluster/transport/store_process.py, bound to the cluster's internal address only,
under a memory cap, with a warden that removes what no holder of the cluster's secret wrote; started
before the workers are placed, so its start overlaps theirs); every actor gets the same frozen `TransportSpec` via
`init_transport(spec)` (a decode worker publishes its control endpoint there), then every prefill
worker forms and warms its channel to every decode worker (`connect_transport`: NCCL communicators,
IPC mappings, copy kernels), so the first request pays none of it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from cluster.errors import PdserveError
from cluster.process.process_template import ProcessTemplate
from cluster.transport.factory import TransportSpec
from cluster.transport.store_process import StoreProcess
from deploy.component_configs import gpus_per_actor
from deploy.config import ClusterConfig
from deploy.gpu_sharing import gpu_sharing

log = logging.getLogger("pdserve.launch")

# (prefill handles by id, decode handles by id, cluster config, **where) -> whatever must stay alive
# while serving (a KVTransportGroup; None without prefill workers); forms the KV transport group.
TransportFormer = Callable[..., Any]


@dataclass
class KVTransportGroup:
    """The KV transport group of a serving cluster: the rendezvous store's process (keep it alive
    while serving; `close()` ends it) and the spec every worker was given; a worker that joins later
    gets the same spec."""

    store: StoreProcess
    spec: Any
    store_wait_s: float = 0.0  # how long forming the group waited for the store's process to listen

    def close(self) -> None:
        self.store.stop()

    def join(self, handles: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any],
             timeout_s: float) -> dict[str, dict[str, float]]:
        """Gives the new workers `handles` the spec, then has every prefill worker in `prefill` form
        and warm its channel to every decode worker in `decode` (pairs formed before are kept, but
        one whose decode worker restarted is formed anew);
        returns the seconds each new pair took, by prefill worker. Blocking.

        All prefill workers at once: each forms its pairs one at a time, in the same order, and a
        decode worker answers hellos in arrival order, so no pair waits on another forever."""
        ray.get([h.init_transport.remote(self.spec) for h in handles.values()], timeout=timeout_s)
        warm = ray.get([h.connect_transport.remote(sorted(decode)) for h in prefill.values()], timeout=timeout_s)
        return dict(zip(prefill, warm))


def start_kv_store(cfg: ClusterConfig, store_host: str, secret: bytes, namespace: str,
                   template: ProcessTemplate | None = None) -> StoreProcess:
    """The rendezvous store's process (returns at once: form_kv_transport_group waits for it), forked
    from `template` (default: this process's shared one for the store alone)."""
    return StoreProcess.start(store_host, cfg.kv_store_port, secret=secret, namespace=namespace,
                              memory_limit_mib=cfg.kv_store_memory_limit_mib, sweep_s=cfg.kv_store_sweep_s,
                              timeout_s=300.0, template=template)


def form_kv_transport_group(prefill: dict[str, Any], decode: dict[str, Any], cfg: ClusterConfig,
                            *, store_host: str = "127.0.0.1", device: str = "cpu",
                            namespace: str = "pdserve", secret: bytes = b"", store: StoreProcess | None = None,
                            **spec: Any) -> KVTransportGroup | None:
    """Connects every prefill worker to every decode worker for KV transfers; returns the
    KVTransportGroup (its rendezvous store must stay alive while the cluster serves), or None without
    prefill workers. Kind: `cfg.kv_transport`, or by default `same_gpu` when the actors share one GPU
    (CUDA IPC, no copy through the host) and `torch_dist` otherwise (NCCL between GPUs, gloo on CPU).
    `secret`: the cluster's, the MAC key of the transports' control channel (cluster/wire/frame_auth.py);
    `store`: the store's process if the caller started it already (start_kv_store; the caller stops
    it if this raises), else one is started here (and stopped if this raises);
    `spec`: further TransportSpec settings (timeouts: the chaos run and the fault tests shorten them).
    """
    if not prefill:
        return None  # every prompt is prefilled on its decode worker: no transfers at all
    if store is None:
        store = start_kv_store(cfg, store_host, secret, namespace)
        try:
            return _form(prefill, decode, cfg, store, store_host, device, namespace, secret, spec)
        except BaseException:
            store.stop()
            raise
    return _form(prefill, decode, cfg, store, store_host, device, namespace, secret, spec)


def _say_gpu_sharing() -> None:
    """The prefill and decode processes share one GPU: how (deploy/gpu_sharing.py) decides what the
    first token waits for once anyone is decoding."""
    if gpu_sharing() == "mps":
        log.info("prefill and decode workers share the GPU through MPS")
    else:
        log.warning("prefill and decode workers share the GPU time-sliced: a prompt's pass waits for the "
                    "decode process's time slice (~10 ms more to the first token under load). Run an MPS "
                    "control daemon (nvidia-cuda-mps-control -d) before starting pdserve to share it "
                    "side by side (README: one GPU for both phases)")


def _form(prefill, decode, cfg: ClusterConfig, store: StoreProcess, store_host: str, device: str, namespace: str,
          secret: bytes, spec: dict) -> KVTransportGroup:
    kind = cfg.kv_transport
    if kind is None:
        shared_gpu = device == "cuda" and (cfg.gpus_per_worker or 0) < 1 and gpus_per_actor(
            cfg, ray.cluster_resources().get("GPU", 0.0)) < 1 and len(ray.nodes()) == 1
        kind = "same_gpu" if shared_gpu else "torch_dist"
    if kind == "same_gpu" and device == "cuda":
        _say_gpu_sharing()
    waited = time.monotonic()
    port = store.wait_ready(cfg.ready_timeout_s)
    waited = time.monotonic() - waited
    log.info("KV rendezvous store (pid %d) listening on %s:%d; its start: %s; waited for it: %.3f s", store.pid,
             store_host, port, store.startup, waited)
    spec = TransportSpec(kind, store_host=store_host, store_port=port,
                         backend="nccl" if device == "cuda" and kind == "torch_dist" else "gloo", namespace=namespace,
                         secret=secret, **spec)
    handles = {**prefill, **decode}
    missing = [wid for wid, h in handles.items() if not hasattr(h, "init_transport")]
    if missing:
        raise PdserveError(f"workers {missing} have no init_transport(spec); run with --prefill-workers 0 "
                           "to prefill on the decode workers")
    group = KVTransportGroup(store, spec, waited)
    try:
        warm = group.join(handles, prefill, decode, cfg.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PdserveError(f"the KV transport group did not form within {cfg.ready_timeout_s:g}s") from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        raise PdserveError(f"forming the KV transport group failed: {str(e).strip().splitlines()[-1]}") from None
    for pid, secs in warm.items():
        log.info("KV channels of %s formed and warmed: %s", pid, {d: round(t, 3) for d, t in secs.items()})
    return group
