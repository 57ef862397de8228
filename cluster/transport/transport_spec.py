"""TransportSpec: the one frozen description of a cluster's KV transport every worker is given
(cluster/transport/factory.py builds transports from it; rendezvous_store.py reaches its store)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.transport.silence_watch import check_timing

KINDS = ("torch_dist", "same_gpu", "local")


@dataclass(frozen=True)
class TransportSpec:
    kind: str  # "torch_dist" | "same_gpu" (CUDA IPC; on CPU the in-process "local" pool) | "local" (= same_gpu)
    store_host: str = ""  # the TCPStore on the cluster's internal address; "" = in-process HashStore (tests)
    store_port: int = 0
    backend: str = "gloo"  # torch_dist payload: "gloo" (CPU caches) | "nccl" (GPU caches)
    bind_host: str = ""  # address gloo and the control inbox bind to; "" = this host's address on the route to store_host
    namespace: str = "pdserve"  # store key prefix; distinct per launch so stale keys never match
    expect_timeout_s: float = 120.0  # decode: longest wait for a reserved transfer's header (queue + prefill)
    transfer_timeout_s: float = 30.0  # either side: longest payload phase once the transfer is claimed
    peer_timeout_s: float = 10.0  # a peer whose heartbeat stalls this long is dead
    heartbeat_s: float = 0.5
    layerwise_min_tokens: int = 1024  # a forward shipping at least this many prompt tokens to one decode
    # worker sends layer i while layer i+1 computes (0: always; shorter ones go in one piece after it)
    # torch_dist staging (staging.py): every launch is one message of at most staging_bytes, gathered into
    # and scattered out of a ring of staging_slots slots per pair and side, allocated when the pair forms;
    # a worker's rings together stay within staging_cap_bytes (a pair past it is refused when it forms).
    staging_bytes: int = 32 << 20
    staging_slots: int = 2
    staging_cap_bytes: int = 1 << 30
    # The cluster's secret (cluster/wire/frame_auth.py): the control channel's frames carry a MAC under it.
    secret: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV transport kind {self.kind!r}; choose one of {KINDS}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.store_host in ("0.0.0.0", "::"):
            raise ValueError("store_host must be the cluster's internal address, not a wildcard")
        if min(self.expect_timeout_s, self.transfer_timeout_s, self.peer_timeout_s, self.heartbeat_s) <= 0:
            raise ValueError("timeouts must be positive")
        check_timing(self.heartbeat_s, self.peer_timeout_s)
        if self.layerwise_min_tokens < 0 or self.staging_bytes <= 0:
            raise ValueError("layerwise_min_tokens must be >= 0, staging_bytes > 0")
        if self.staging_slots < 2:
            raise ValueError(f"staging_slots must be >= 2 (a receive is posted while the slot before it scatters), "
                             f"got {self.staging_slots}")
        if self.staging_cap_bytes < self.staging_slots * self.staging_bytes:
            raise ValueError(f"staging_cap_bytes={self.staging_cap_bytes} holds not even one pair's ring "
                             f"({self.staging_slots} x staging_bytes={self.staging_bytes})")
