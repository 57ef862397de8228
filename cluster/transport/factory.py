"""How a worker gets its KV transport: one frozen TransportSpec for the whole cluster, one call.

    spec = TransportSpec("torch_dist", store_host=internal_ip, store_port=store.port)  # launcher
    transport = create_transport(spec, runner.kv_cache, worker_id, role="prefill")    # each worker
    transport.connect(decode_worker_ids)                   # prefill workers, before the cluster is ready

The transport is a ControlledTransport (control.py) over the payload chosen here: TorchDistPayload
(kind "torch_dist"), TPPayload (torch_dist, a tensor-parallel worker's rank 0) or SameGPUPayload
("same_gpu" / "local").
"""

from __future__ import annotations

from functools import partial

import torch

from cluster.transport.base import KVTransport
from cluster.transport.control import ControlledTransport
from cluster.transport.payload import kv_payload_view
from cluster.transport.plan import KVNumerics
from cluster.transport.rendezvous_store import store_factory
from cluster.transport.transport_spec import KINDS, TransportSpec

__all__ = ["KINDS", "TransportSpec", "create_transport", "kv_payload_view", "store_factory"]  # (re-exported)


def create_transport(spec: TransportSpec, kv_cache: torch.Tensor, worker_id: str, role: str,
                     numerics: KVNumerics | None = None, group=None, kv_heads: int | None = None) -> KVTransport:
    """role: "prefill" | "decode". Returns at once; a prefill worker then `connect`s its decode peers.
    group: the worker's TPGroup when it is tensor-parallel (this process its rank 0; kv_heads: the
    model's KV heads): its followers' payload agents join (tp_payload.py).
    numerics: what the cache holds (plan.KVNumerics); None describes the cache's own dtype. An FP8
    cache moves as its uint8 view (`kv_payload_view`), and the pair formation compares the numerics
    instead (plan.check_pair_numerics)."""
    if numerics is None:
        numerics = KVNumerics(str(kv_cache.dtype).removeprefix("torch."), str(kv_cache.dtype))
    kv_cache = kv_payload_view(kv_cache)
    factory = store_factory(spec)
    tp_size = group.size if group is not None else 1
    if tp_size > 1:
        if spec.kind != "torch_dist":
            raise ValueError(f"a tensor-parallel worker moves KV over torch_dist, not {spec.kind!r}")
        from cluster.transport.tp_payload import TPPayload

        payload = partial(TPPayload, group=group, kv_heads=kv_heads)
    elif spec.kind == "torch_dist":
        from cluster.transport.torch_dist import TorchDistPayload

        payload = TorchDistPayload
    else:
        from cluster.transport.same_gpu import SameGPUPayload

        payload = SameGPUPayload
    return ControlledTransport(spec, kv_cache, worker_id, role, factory, payload,
                               kv_heads=kv_heads if tp_size > 1 else None, tp_size=tp_size, numerics=numerics)
