"""The cluster's rendezvous store: the launcher hosts it (`start_store`, on the internal address, so it
outlives any worker) in a child process of its own, under a memory cap and with a warden
(store_process.py); a tensor-parallel group's leader hosts its group's in-process (tp_group.py); every
worker, and every follower rank's payload agent, reaches the cluster's through
`store_factory(spec)`, one client per thread, each an AuthenticatedStore under the cluster's secret
(a value no holder of it wrote is never used). What the store holds is control.py's docstring."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import TYPE_CHECKING

import torch.distributed as dist

from cluster.errors import PdserveError
from cluster.transport.authenticated_store import AuthenticatedStore

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
    """The rendezvous store's server (the launcher's, so it outlives any worker; a tensor-parallel
    leader's for its group), listening on `host` only. port=0 picks a free port: read it back from
    `store.port`.

    A TCPStore master given a host still listens on every interface ('::'); so the listening socket
    is made here, bound to `host`, and handed over (`master_listen_fd`). A wildcard address is
    refused: the store takes unauthenticated writes."""
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
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's event loop owns (and closes) the descriptor now
    return store


_HASH_STORES: dict[str, dist.HashStore] = {}


def store_factory(spec: TransportSpec):
    """A zero-argument function returning a store client (one per thread: clients are not shared),
    sealing and checking every value under the cluster's secret (authenticated_store.py)."""
    if not spec.store_host:
        store = AuthenticatedStore(_HASH_STORES.setdefault(spec.namespace, dist.HashStore()), spec.secret)
        return lambda: store
    timeout = datetime.timedelta(seconds=max(spec.transfer_timeout_s, 30.0))
    return lambda: AuthenticatedStore(dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                                    wait_for_workers=False, timeout=timeout, use_libuv=True),
                                      spec.secret)
