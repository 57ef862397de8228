"""A real two-node Ray cluster on one machine: `ray start --head` with a `prefill` resource and a
second `ray start --address` with a `decode` resource; `pdserve serve --address` joins it, pins
prefill to the first node and decode to the second, and answers HTTP over the cross-node gloo group."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from deploy.ray_runtime import RAY_WORKER_NICENESS_ENV

pytestmark = pytest.mark.cluster  # a Ray head and worker node started by `ray start`


# Asks each worker actor which node it runs on, and that node which custom resources it offers.
PLACEMENT_PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
nodes = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
out = {}
for a in ray.util.list_named_actors(all_namespaces=True):
    role = a["name"].rsplit("-", 2)[-2]
    if role in ("prefill", "decode"):
        h = ray.get_actor(a["name"], namespace=a["namespace"])
        node = ray.get(h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
        out[role] = nodes[node]
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _ray_node(args: list[str], env: dict) -> subprocess.Popen:
    # --block keeps the node's processes children of this one, so the test stops exactly its own
    # nodes (never `ray stop`, which would stop every Ray on the machine).
    head = ["--include-dashboard=false"] if "--head" in args else []
    return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
                             "--num-cpus=2", *head, *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(procs: list[subprocess.Popen], timeout: float = 5) -> None:
    """SIGTERM to every process group at once (each stops its own), then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def two_node_cluster():
    # A short temp dir: Ray's Unix sockets live under it and their paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
    gcs = _free_port()
    # Token authentication on, as the deployment guide asks: every node and client shares the token.
    # Its workers at this process's priority, as pdserve's own local Ray runs them (deploy/ray_runtime.py).
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           RAY_WORKER_NICENESS_ENV: "0"}
    # Ray starts its client server (default port 10001) only when ray[client] (grpcio) is installed,
    # and refuses --ray-client-server-port without it: pick a free port only where it will be used.
    client = [f"--ray-client-server-port={_free_port()}"] if importlib.util.find_spec("grpc") else []
    head = _ray_node(["--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", '--resources={"prefill": 1}',
                      f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={_free_port()}", *client], env)
    nodes = [head]
    try:
        address = f"127.0.0.1:{gcs}"
        deadline = time.monotonic() + 60
        # Its GCS port first (a cheap poll), then `ray status` (a Python process of a second or two).
        while not _accepts(gcs):
            assert time.monotonic() < deadline and head.poll() is None, "head node did not start"
            time.sleep(0.05)
        while subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", f"--address={address}"],
                             env=env, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and head.poll() is None, "head node did not start"
            time.sleep(0.5)
        nodes.append(_ray_node([f"--address={address}", "--node-ip-address=127.0.0.1", '--resources={"decode": 1}',
                                f"--dashboard-agent-listen-port={_free_port()}"], env))
        # Until the second node has joined: `pdserve serve` fails at once on a cluster that can never
        # place its workers (seen on a loaded machine: the head alone, "decode 0 in all").
        deadline = time.monotonic() + 120
        while "decode" not in subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status",
                                              f"--address={address}"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline and nodes[-1].poll() is None, "the decode node did not join"
            time.sleep(0.5)
        yield address, env
    finally:
        _stop(nodes[::-1])
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_prefill_and_decode_pinned_to_their_nodes(two_node_cluster, demo_model_dir, tmp_path):
    address, env = two_node_cluster
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(json.dumps({  # YAML is a superset of JSON
        "address": address, "port": 0, "prefill_workers": 1, "decode_workers": 1, "device": "cpu",
        "prefill_resources": {"prefill": 1}, "decode_resources": {"decode": 1}, "kv_transport": "torch_dist",
        "cpu_num_blocks": 256, "served_model_name": "pdserve-demo",
        "prefill_placement": "static",  # every prompt crosses the nodes (adaptive may keep it local)
    }))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:  # port 0: the server picks a free port and prints its URL
        # --no-warmup: where the workers run is the subject, not their warm-up (test_role_switch.py's).
        server = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", str(demo_model_dir), "--config",
                                   str(cfg), "--no-warmup"], env={**env, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (m := re.search(r"serving \S+ at (http://\S+)/v1", log.read_text())):
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "pdserve serve did not start"
            time.sleep(0.1)
        url = m.group(1)
        while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "pdserve serve did not become ready"
            time.sleep(0.1)

        # Which node runs which worker: ask the cluster itself.
        placed = subprocess.run([sys.executable, "-c", PLACEMENT_PROBE, address], env=env, capture_output=True,
                                text=True, timeout=120)
        assert placed.returncode == 0, placed.stderr
        roles = json.loads(placed.stdout.strip().splitlines()[-1])
        assert "prefill" in roles["prefill"] and "decode" not in roles["prefill"]
        assert "decode" in roles["decode"] and "prefill" not in roles["decode"]

        prompt = "Once upon a time there was a small model that wanted to tell stories about the sea"
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "pdserve-demo", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        from cluster.engine.engine import LLMEngine
        from cluster.sampling.sampling_params import SamplingParams

        ref = LLMEngine(demo_model_dir).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert r.json()["choices"][0]["text"] == ref[0].text
        metrics = httpx.get(f"{url}/metrics").text
        sent = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:kv_transfer_bytes_total")]
        assert sent and float(sent[0].split()[-1]) > 0  # the KV crossed nodes through the transfer group
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
