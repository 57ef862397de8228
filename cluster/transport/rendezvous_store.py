"""The cluster's rendezvous store: the launcher hosts it (`start_store`, on the internal address, so it
outlives any worker); every worker, and every follower rank's payload agent, reaches it through
`store_factory(spec)`, one client per thread. What the store holds is control.py's docstring."""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from cluster.transport.transport_spec import TransportSpec


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (the cluster's internal network): what we bind."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 1))  # UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]


def start_store(host: str, port: int = 0, timeout_s: float = 60.0) -> dist.TCPStore:
    """The launcher hosts the rendezvous store (so it outlives any worker) on the internal address.
    port=0 picks a free port: read it back from `store.port`."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)


_HASH_STORES: dict[str, dist.HashStore] = {}


def store_factory(spec: TransportSpec):
    """A zero-argument function returning a store client (one per thread: clients are not shared)."""
    if not spec.store_host:
        store = _HASH_STORES.setdefault(spec.namespace, dist.HashStore())
        return lambda: store
    timeout = datetime.timedelta(seconds=max(spec.transfer_timeout_s, 30.0))
    return lambda: dist.TCPStore(spec.store_host, spec.store_port, is_master=False, wait_for_workers=False,
                                 timeout=timeout, use_libuv=True)
