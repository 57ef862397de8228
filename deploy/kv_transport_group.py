"""The KV transport group of a serving cluster: every prefill worker connected to every decode worker
for KV transfers, formed before /ready, joined by every worker that starts later (a role switch, a
Ray restart).

The launcher hosts the TCPStore (master) the transports rendezvous through (`start_store`: bound
to the cluster's internal address only); every actor gets the same frozen `TransportSpec` via
`init_transport(spec)` (a decode worker publishes its control endpoint there), then every prefill
worker forms and warms its channel to every decode worker (`connect_transport`: NCCL communicators,
IPC mappings, copy kernels), so the first request pays none of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import ray

from cluster.errors import PdserveError
from cluster.transport.factory import TransportSpec
from cluster.transport.rendezvous_store import start_store
from deploy.component_configs import gpus_per_actor
from deploy.config import ClusterConfig

log = logging.getLogger("pdserve.launch")

# (prefill handles by id, decode handles by id, cluster config, **where) -> whatever must stay alive
# while serving (a KVTransportGroup; None without prefill workers); forms the KV transport group.
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
        ray.get([h.init_transport.remote(self.spec) for h in handles.values()], timeout=timeout_s)
        warm = ray.get([h.connect_transport.remote(sorted(decode)) for h in prefill.values()], timeout=timeout_s)
        return dict(zip(prefill, warm))


def form_kv_transport_group(prefill: dict[str, Any], decode: dict[str, Any], cfg: ClusterConfig,
                            *, store_host: str = "127.0.0.1", device: str = "cpu",
                            namespace: str = "pdserve", secret: bytes = b"", **spec: Any) -> KVTransportGroup | None:
    """Connects every prefill worker to every decode worker for KV transfers; returns the
    KVTransportGroup (its rendezvous store must stay alive while the cluster serves), or None without
    prefill workers. Kind: `cfg.kv_transport`, or by default `same_gpu` when the actors share one GPU
    (CUDA IPC, no copy through the host) and `torch_dist` otherwise (NCCL between GPUs, gloo on CPU).
    `secret`: the cluster's, the MAC key of the transports' control channel (cluster/wire/frame_auth.py);
    `spec`: further TransportSpec settings (timeouts: the chaos run and the fault tests shorten them).
    """
    if not prefill:
        return None  # every prompt is prefilled on its decode worker: no transfers at all
    kind = cfg.kv_transport
    if kind is None:
        shared_gpu = device == "cuda" and (cfg.gpus_per_worker or 0) < 1 and gpus_per_actor(
            cfg, ray.cluster_resources().get("GPU", 0.0)) < 1 and len(ray.nodes()) == 1
        kind = "same_gpu" if shared_gpu else "torch_dist"
    store = start_store(store_host, cfg.kv_store_port, timeout_s=300.0)
    spec = TransportSpec(kind, store_host=store_host, store_port=store.port,
                         backend="nccl" if device == "cuda" and kind == "torch_dist" else "gloo", namespace=namespace,
                         secret=secret, **spec)
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
