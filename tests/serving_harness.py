"""Starting a real serving cluster in tests, shared by every test package that needs one
(tests/router, tests/reliability, ...): the real launcher (`ServingCluster`) with real Ray actors, the
router on a thread of the test process and the API-server processes (uvicorn) on 127.0.0.1, reached
over real HTTP."""

from __future__ import annotations

import json
import logging
import time

import httpx

MODEL = "pdserve-demo"

# Small, fast CPU settings; a test overrides what it exercises. Prompts are placed by the static
# threshold (tests of a path need it to be taken for sure; adaptive placement is tested where it is
# the subject), and the prefill-queue admission limit is off (a CPU prefills ~100x slower than a GPU).
# warmup=False: a worker's warm-up (every prefill shape twice, the grammar engine with its compile
# process, a request per sampler variant) is ~16 s of CPU per 1P+2D cluster start on two cores (37 s of
# CPU, 20.5 s to /ready with it; 21.5 s and 12 s without), paid by every cluster the suite starts.
# Warm-up is tested where it is the subject: tests/deploy/test_role_switch.py (every worker warmed
# before /ready), tests/decode_worker/test_warmup.py, the prefill worker's structured-output tests,
# and the `pdserve serve` processes of test_serve_command.py's first test, test_drain.py and the
# quickstart, which start with the CLI's default (warm-up on).
# stats_interval_s: the router's default (0.1 s). At 0.05 s an idle 1P+2D cluster cost ~0.25 of a core,
# almost all of it the Ray calls of the stats polls, under every cluster test of the run.
CPU_DEFAULTS = dict(served_model_name=MODEL, port=0, cpu_num_blocks=256, max_num_seqs=32, use_cuda_graph=False,
                    stats_interval_s=0.1, cpus_per_worker=1.0, device="cpu", ready_timeout_s=120, api_servers=1,
                    prefill_placement="static", max_prefill_queue_s=1e9, warmup=False)


def init_ray(num_cpus: int = 16) -> bool:
    """Starts Ray unless a caller already did; returns whether this call owns it (and must shut it down).
    The CPUs are Ray's bookkeeping, not cores: the run's one Ray holds the session-long clusters
    (tests/router/conftest.py) while other modules start theirs, up to 4 workers of 1 CPU each."""
    import ray

    from deploy.ray_runtime import workers_at_launcher_priority

    if ray.is_initialized():
        return False
    workers_at_launcher_priority()  # and so the cluster stream's actors above the other stream (conftest)
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    return True


def start_cluster(demo_model_dir, *, prefill_actor_cls=None, decode_actor_cls=None, form_transport_group=None,
                  **overrides):
    """A started cluster (in a thread of this process) that answers /ready; `sc.url` is its base URL."""
    from deploy.config import ClusterConfig
    from deploy.serving_cluster import ServingCluster

    cfg = ClusterConfig(**{"model": str(demo_model_dir), **CPU_DEFAULTS, **overrides})
    kwargs = dict(prefill_actor_cls=prefill_actor_cls, decode_actor_cls=decode_actor_cls)
    if form_transport_group is not None:
        kwargs["form_transport_group"] = form_transport_group
    sc = ServingCluster(cfg, **kwargs)
    sc.start_in_thread()
    wait_ready(sc.url)
    return sc


def gateway_status(sc, fresh: bool = True) -> dict[str, tuple[int, int]]:
    """Per API-server process: (asyncio tasks on its loop, requests whose tokens it waits for), from
    its heartbeats to the router (`fresh`: after one more heartbeat)."""
    if fresh:
        time.sleep(0.6)
    return {g.gateway_id: (g.tasks, g.open_streams) for g in sc.router_server.gateways.values() if g.up}


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready")


def worker_stats(sc, roles=("decode",)) -> dict:
    """Stats of the live workers of these roles (a worker a test killed is left out)."""
    import ray

    handles = {}
    if "decode" in roles:
        handles.update(sc.workers.decode)
    if "prefill" in roles:
        handles.update(sc.workers.prefill)
    alive = {}
    for wid, h in handles.items():
        try:
            alive[wid] = ray.get(h.stats.remote(), timeout=10)
        except Exception:
            pass
    return alive


def check_blocks(sc, roles=("decode", "prefill")) -> None:
    """Block accounting on every live worker: each KV block in exactly one pool state, every reference
    held by a request the worker knows (no leaked, no doubly owned block). Raises on a violation."""
    import ray
    from ray.exceptions import RayActorError

    handles = {**(sc.workers.decode if "decode" in roles else {}), **(sc.workers.prefill if "prefill" in roles else {})}
    for wid, h in handles.items():
        if not hasattr(h, "check_blocks"):  # a test double without a block pool
            continue
        try:
            ray.get(h.check_blocks.remote(), timeout=10)
        except RayActorError:
            pass  # a worker the test killed


def wait_clean(sc, roles=("decode", "prefill"), timeout_s: float = 20.0, router: bool = True) -> dict:
    """Waits until every live worker holds no request and every KV block is back in its pool (and,
    with `router`, the router holds no request), then checks the block accounting; returns the
    workers' stats. Fails otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(sc, roles)
        clean = all(s.free_blocks == s.total_blocks and s.running == 0 and s.waiting == 0 for s in stats.values())
        r = sc.router
        if clean and (not router or (not r.inflight and r.admission.num_admitted == 0)):
            check_blocks(sc, roles)
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"not clean: workers {stats}, router inflight {list(r.inflight)}, "
                                 f"admitted {r.admission.num_admitted}")
        time.sleep(0.05)


def wait_idle(sc, timeout_s: float = 15.0) -> list:
    """Waits until every decode worker holds no request and all its blocks are free; returns stats."""
    return list(wait_clean(sc, roles=("decode",), timeout_s=timeout_s, router=False).values())


async def completion_text(client: httpx.AsyncClient, body: dict) -> str:
    """POSTs a /v1/completions body (streamed or not, as body["stream"] says) and returns its text,
    asserting a 200."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text
