"""The deployment files parse and carry what Ray and KubeRay require."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_ray_up_yaml_passes_rays_own_validation():
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(cfg))
    types = cfg["available_node_types"]
    assert types["prefill_gpu"]["resources"].get("prefill") and types["decode_gpu"]["resources"].get("decode")
    assert any("RAY_AUTH_MODE=token" in c for c in cfg["head_start_ray_commands"])
    assert any("--dashboard-host=127.0.0.1" in c for c in cfg["head_start_ray_commands"])


def _kuberay_docs():
    return list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))


def _ray_resources(params: dict) -> dict:
    # KubeRay pastes rayStartParams into the `ray start` shell line as they are, so `resources` is a
    # double-quoted, backslash-escaped JSON object: "{\"prefill\": 1}".
    raw = params.get("resources", '"{}"')
    assert raw.startswith('"') and raw.endswith('"'), "resources must be a quoted JSON string"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def _check_pod_template(template: dict) -> dict:
    containers = template["spec"]["containers"]
    assert containers and all(c.get("name") and c.get("image") for c in containers)
    for c in containers:
        names = {e["name"] for e in c.get("env", [])}
        if c["name"].startswith("ray-"):
            assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= names, f"{c['name']} lacks Ray token auth"
    return containers[0]


def test_kuberay_raycluster_has_the_required_fields():
    cluster = next(d for d in _kuberay_docs() if d["kind"] == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"]
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    head_main = _check_pod_template(head["template"])
    assert {p["containerPort"] for p in head_main["ports"]} >= {6379}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for name, g in groups.items():
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
        assert _ray_resources(g["rayStartParams"]) == {name: 1}
        worker = _check_pod_template(g["template"])
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"]


def test_gateway_service_selects_the_head_pod_and_its_port():
    docs = _kuberay_docs()
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    service = next(d for d in docs if d["kind"] == "Service")
    # KubeRay labels the head pod with these two labels.
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    gateway = next(c for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "pdserve")
    assert service["spec"]["ports"][0]["targetPort"] in {p["containerPort"] for p in gateway["ports"]}
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_pdserve_cluster_yaml_is_a_valid_config():
    from deploy.component_configs import worker_config
    from deploy.config import ClusterConfig

    cfg = ClusterConfig.load(DEPLOY / "pdserve-cluster.yaml")
    assert cfg.prefill_resources == {"prefill": 1} and cfg.decode_resources == {"decode": 1}
    assert cfg.kv_store_port == 29600
    wcfg = worker_config(cfg, "/models/m", "cuda")
    assert wcfg.attention_backend == "triton"


# -- the manifests against the config they start (issue 23) ---------------------------------------------
ROOT = DEPLOY.parent
IMAGE_ROOT = "/opt/pdserve/"  # the Dockerfile's WORKDIR: the checkout's files are copied under it


def _copied_dirs() -> set[str]:
    import re

    return set(re.findall(r"^COPY (\S+) \./\1$", (DEPLOY / "Dockerfile").read_text(), re.M))


def test_the_image_holds_every_package_and_the_config():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    assert packages <= _copied_dirs(), packages - _copied_dirs()  # `pip install .` in the image needs them all
    assert "deploy" in _copied_dirs()  # and with it deploy/pdserve-cluster.yaml, which both manifests start with


def _in_image(path: str) -> Path:
    """A path inside the image, as a file of this checkout (the Dockerfile copies deploy/ etc. under WORKDIR)."""
    assert path.startswith(IMAGE_ROOT), path
    rel = path[len(IMAGE_ROOT):]
    assert rel.split("/")[0] in _copied_dirs(), f"{path}: not copied into the image"
    return ROOT / rel


def _started_config(command_line: str):
    """The ClusterConfig a `pdserve serve ...` command line starts with (its --config read from the image)."""
    import shlex

    from deploy.cli import build_parser
    from deploy.config import ClusterConfig
    from deploy.config_flags import overrides_from_args

    argv = shlex.split(command_line)
    argv = argv[argv.index("pdserve") + 1:]
    args = build_parser().parse_args(argv)
    return ClusterConfig.load(_in_image(args.config), overrides_from_args(args), env={})


def _pdserve_command(cluster: dict) -> str:
    gateway = next(c for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "pdserve")
    line = " ".join(gateway["args"])
    return line[line.index("exec pdserve ") + len("exec "):]


def _cpus(q: str) -> float:
    return float(q[:-1]) / 1000 if str(q).endswith("m") else float(q)


def test_kuberay_groups_offer_exactly_the_workers_the_config_starts():
    cluster = next(d for d in _kuberay_docs() if d["kind"] == "RayCluster")
    cfg = _started_config(_pdserve_command(cluster))
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    autoscaling = cluster["spec"].get("enableInTreeAutoscaling", False)
    for role, workers, needs in (("prefill", cfg.prefill_workers, cfg.prefill_resources),
                                 ("decode", cfg.decode_workers, cfg.decode_resources)):
        g = groups[role]
        pods = g["replicas"]
        if not autoscaling:  # nothing adds a pod later: the group is what there is
            assert g["minReplicas"] == pods == g["maxReplicas"], role
        offered = _ray_resources(g["rayStartParams"])
        container = g["template"]["spec"]["containers"][0]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        per_pod = max(1, min(int(offered[k] // v) for k, v in needs.items()) if needs else workers)
        # every worker finds its custom resources, its GPU and its CPUs; no pod is left idle
        assert pods * per_pod >= workers and (pods - 1) * per_pod < workers, (role, pods, per_pod, workers)
        assert gpus >= per_pod * (cfg.gpus_per_worker or 0), role
        assert _cpus(container["resources"]["limits"]["cpu"]) >= per_pod * cfg.cpus_per_worker, role
    assert cfg.device == "cuda" and cfg.gpus_per_worker == 1


def test_ray_up_runs_from_a_clean_checkout():
    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    mounts = cfg["file_mounts"]
    src_target = next(t for t, s in mounts.items() if s in (".", "./"))  # the checkout itself
    token_target, token_src = next((t, s) for t, s in mounts.items() if "ray_auth_token" in s)
    # every other mount source is in the checkout; the token is the documented secret step's output,
    # in a folder git ignores (never committed)
    for target, source in mounts.items():
        if target != token_target:
            assert (ROOT / source).exists(), source
    readme = (DEPLOY / "README.md").read_text()
    step = f"openssl rand -hex 32 > {token_src.removeprefix('./')}"
    assert step in readme and step in (DEPLOY / "ray-cluster.yaml").read_text()
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", token_src], capture_output=True)
    assert ignored.returncode == 0, f"{token_src} must be git-ignored"
    assert all(f"RAY_AUTH_TOKEN_PATH={token_target}" in c for c in cfg["head_start_ray_commands"] if "ray start" in c)
    assert all(f"RAY_AUTH_TOKEN_PATH={token_target}" in c for c in cfg["worker_start_ray_commands"] if "ray start" in c)
    # the image: built on each node from the synced checkout, under the name the container runs
    image = cfg["docker"]["image"]
    host_src = f"/tmp/ray_tmp_mount/{cfg['cluster_name']}{src_target}"
    builds = [c for c in cfg["initialization_commands"] if c.startswith("docker build")]
    assert builds and f"-t {image}" in builds[0] and builds[0].endswith(host_src)
    assert f"-f {host_src}/deploy/Dockerfile" in builds[0] and cfg["docker"]["pull_before_run"] is False
    # the command the README runs: its config is in the image, and the node types can hold its workers
    line = next(ln for ln in cfg_comments(DEPLOY / "ray-cluster.yaml") if "ray exec" in ln)
    served = _started_config(line.split("'")[1])
    types = cfg["available_node_types"]
    for role, workers, needs in (("prefill", served.prefill_workers, served.prefill_resources),
                                 ("decode", served.decode_workers, served.decode_resources)):
        slots = sum(t.get("max_workers", 0) * min(t["resources"].get(k, 0) // v for k, v in needs.items())
                    for t in types.values())
        gpus = sum(t.get("max_workers", 0) * t["resources"].get("GPU", 0) for t in types.values()
                   if all(t["resources"].get(k, 0) >= v for k, v in needs.items()))
        assert slots >= workers and gpus >= workers * (served.gpus_per_worker or 0), role


def cfg_comments(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.lstrip().startswith("#")]


def test_every_ray_node_runs_pdserves_actors_at_its_own_priority():
    """Ray's default worker_niceness (15) would put the prefill and decode actors below every other
    process of their node (deploy/ray_runtime.py): each node of both manifests starts Ray with 0."""
    from deploy.ray_runtime import RAY_WORKER_NICENESS_ENV

    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in cfg[key] if "ray start" in c]
    assert len(starts) == 2 and all(f"{RAY_WORKER_NICENESS_ENV}=0 " in c for c in starts), starts
    cluster = next(d for d in _kuberay_docs() if d["kind"] == "RayCluster")
    pods = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        ray_container = pod["spec"]["containers"][0]
        assert {"name": RAY_WORKER_NICENESS_ENV, "value": "0"} in ray_container["env"], ray_container["name"]
