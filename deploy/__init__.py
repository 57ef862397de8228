"""The application layer, on top of everything: it may import the workers and the router; nothing
below it imports it (tests/test_layering.py).

    cli.py                the `pdserve` command line (`serve`, `generate`, `demo-model`; `loadtest` through its entry point)
    config.py             ClusterConfig: every `pdserve serve` setting (flag and YAML key)
    config_flags.py       ClusterConfig's fields as `pdserve serve` flags, and the given flags as overrides
    component_configs.py  ClusterConfig -> each component's config (workers, router, admission, API servers)
    serving_cluster.py    ServingCluster: start order, serve_forever, drain, shutdown
    ray_workers.py        RayWorkers: placement group, actors, warm-up, spawn/retire, rejoin
    kv_transport_group.py the KV transport group: rendezvous store, form, join
    ray_runtime.py        joining or starting Ray, and stopping it within a budget
    api_server.py         the API-server processes (gateways sharing the HTTP port)
    planner_loop.py, role_switcher.py   the P:D planner's loop and its role switches
"""
