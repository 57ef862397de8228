"""The deployment files parse and carry what Ray and KubeRay require."""

import json
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


@pytest.mark.parametrize("path", ["Dockerfile"])
def test_dockerfile_installs_every_package(path):
    text = (DEPLOY / path).read_text()
    for pkg in ("cluster", "prefill_worker", "decode_worker", "router", "loadtest"):
        assert f"COPY {pkg} ./{pkg}" in text


def test_pdserve_cluster_yaml_is_a_valid_config():
    from deploy.component_configs import worker_config
    from deploy.config import ClusterConfig

    cfg = ClusterConfig.load(DEPLOY / "pdserve-cluster.yaml")
    assert cfg.prefill_resources == {"prefill": 1} and cfg.decode_resources == {"decode": 1}
    assert cfg.kv_store_port == 29600
    wcfg = worker_config(cfg, "/models/m", "cuda")
    assert wcfg.attention_backend == "triton"
