"""RouterConfig: the Router's frozen settings (router/router.py).

Its own module, importing nothing, so that the application's ClusterConfig (deploy/config.py) takes
every router default from here without importing the router (Ray, torch): `pdserve serve --help`
stays light, and a default lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    prefill_placement: str = "adaptive"  # router.placement.local_prefill_policy: "adaptive" | "static"
    local_prefill_threshold: int = 0  # prompts of at most this many tokens are prefilled on D
    itl_cost_weight: float = 20.0  # TTFT seconds one second of added TPOT is worth (adaptive mode)
    stats_interval_s: float = 0.1
    call_timeout_s: float = 30.0  # reserve / submit_local / stats / abort
    prefill_timeout_s: float = 600.0  # P.submit: queue + prefill + transfer
    reserve_wait_s: float = 2.0  # how long a request may wait for a D with room before a 429
    migration_wait_s: float = 60.0  # how long a migrated request may wait for room (or a restart)
    migrate_on_worker_death: bool = True  # re-place a dead worker's requests (else: an error event)
    # How often Ray restarts a dead worker (-1: always, 0: never, the router alone does not assume it).
    # While it may, a migration waits for one to come back; past it, the worker is gone for good.
    worker_max_restarts: int = 0
    max_migrations: int = 3  # per request
    unhealthy_after_failures: int = 3  # missed stats polls (a dead Ray actor counts at once)
    prefill_policy: str = "least_outstanding_tokens"
    decode_policy: str = "least_loaded"

    @property
    def workers_restart(self) -> bool:
        """Ray restarts dead workers: a migration waits for one to come back."""
        return self.worker_max_restarts != 0
