"""Ray as the launcher drives it: joining a Ray cluster or starting a local instance, and leaving it
within a time budget whatever died first (`pdserve serve` exits within drain_timeout_s + 5 s).

Hazard: once Ray's control plane (its GCS) is gone or hung, every Ray call waits for it (~60 s
"Failed to connect to GCS"). So stopping runs on a thread that the launcher stops waiting for after
RAY_STOP_BUDGET_S (`run_within`), and a local Ray whose GCS process is gone gets no budget at all
(`gcs_gone`): what this process started of Ray is killed with it (`kill_children`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Callable

import psutil
import ray

from cluster.errors import PdserveError
from deploy.config import ClusterConfig

log = logging.getLogger("pdserve.launch")

# Longest wait for Ray while stopping (workers' shutdown calls, kills, ray.shutdown).
RAY_STOP_BUDGET_S = 3.0

# Ray starts its worker processes (every prefill and decode actor, and what they start: the token
# publisher, TP ranks' helpers) at nice 15 by default (its `worker_niceness`), below the API servers,
# the raylet and any client on the host. Under CPU contention the decode loop's host work, the first
# token's draw and the KV sends would then yield to all of them. The actors of a Ray started here run
# at the launcher's own priority instead; an operator's RAY_worker_niceness wins.
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"


def workers_at_launcher_priority() -> None:
    """Before a local Ray starts (its raylet reads the setting from the environment it inherits)."""
    os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")


def init_ray(cfg: ClusterConfig) -> bool:
    """Joins `cfg.address` or starts a local Ray sized for the workers; True if this call did (the
    caller then shuts it down), False if the caller's Ray (a test, a notebook) was running already."""
    if ray.is_initialized():
        return False  # the caller's Ray: use it, and leave it running
    # Every rank is an actor holding cpus_per_worker (a TP worker's bundle holds all its ranks'): a local
    # Ray started here counts that many logical CPUs at least, as a user asking for TP 2 on a 2-core
    # machine expects it to run (slower), not to wait for a placement that can never be ready.
    ranks = cfg.prefill_workers * cfg.prefill_tp + cfg.decode_workers * cfg.decode_tp
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if cfg.address is None:
        kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(ranks * cfg.cpus_per_worker))
        workers_at_launcher_priority()
    try:
        ray.init(address=cfg.address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise PdserveError(f"cannot start or join Ray at {cfg.address or 'a local instance'}: "
                           f"{str(e).splitlines()[0]}") from None
    return True


def gcs_gone() -> bool:
    """True when this process started a local Ray whose GCS server process is no longer among its
    descendants: every Ray call would then wait for it, so nothing is asked of Ray."""
    for p in psutil.Process().children(recursive=True):
        try:
            # A killed GCS stays listed, as a zombie, until Ray's bookkeeping reaps it.
            if p.name().startswith("gcs_server") and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            pass
    return True


def kill_children() -> None:
    """Kills every process this one started (Ray's GCS, raylet and workers of a local instance)."""
    for p in psutil.Process().children(recursive=True):
        try:
            p.kill()
        except psutil.Error:
            pass


def run_within(fn: Callable[[], None], budget_s: float, what: str) -> bool:
    """Runs `fn` on a daemon thread; False if it took longer than `budget_s` (it goes on in the
    background). An exception in it is logged as `what` failing: stopping goes on anyway."""
    done = threading.Event()

    def run():
        try:
            fn()
        except Exception:  # noqa: BLE001 - stopping anyway
            log.exception("%s failed", what)
        finally:
            done.set()
    threading.Thread(target=run, name="ray-stop", daemon=True).start()
    return done.wait(budget_s)
