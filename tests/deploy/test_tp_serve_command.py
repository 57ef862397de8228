"""Tensor parallelism from the command line (issue 36): `pdserve serve` with a TP prefill or decode
worker, as a user types it on a small machine, serves and answers greedy equal to the in-process
engine (its local Ray counts every rank's CPUs); a Ray cluster that can never hold the workers is an
error at once naming what is missing (`unmet`), not a silent wait."""

from __future__ import annotations

import signal

import httpx
import pytest

from cluster.sampling.sampling_params import SamplingParams
from deploy.placement_check import unmet
from serve_process import start_serve

pytestmark = pytest.mark.cluster  # `pdserve serve` subprocesses, joining the run's Ray

PROMPT = "A long story about the sea, the wind and the sailors who crossed it"  # remote prefill


def test_unmet_packs_bundles_on_nodes_and_names_what_is_missing():
    one_node = [{"CPU": 2.0, "memory": 1e9}]
    p_tp2, d = ("a prefill worker of TP 2 (2 ranks)", {"CPU": 2.0}), ("a decode worker", {"CPU": 1.0})
    why = unmet([p_tp2, d], one_node)
    assert why is not None and why.startswith("a decode worker needs CPU 1 on one node") and "CPU 2 in all" in why
    assert unmet([p_tp2, d], [{"CPU": 3.0}]) is None
    assert unmet([p_tp2, d], [{"CPU": 1.0}, {"CPU": 2.0}]) is None  # each bundle on one node
    gpu = unmet([("a decode worker of TP 2 (2 ranks)", {"CPU": 2.0, "GPU": 2.0})], [{"CPU": 8.0, "GPU": 1.0},
                                                                                    {"CPU": 8.0, "GPU": 1.0}])
    assert gpu is not None and "GPU 2 on one node" in gpu and "largest node CPU 8, GPU 1" in gpu


@pytest.mark.timeout(420)
# Each start: 23-27 s on a quiet 2-core machine (3 rank processes load the model), minutes under load.
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_tp_serves_from_the_command_line(demo_model_dir, reference_engine, ray_address, prefill_tp, decode_tp):
    pytest.importorskip("prefill_worker.actor")
    ref = reference_engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    proc, url, out = start_serve(demo_model_dir, "--prefill-workers", "1", "--decode-workers", "1",
                                 "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                                 "--prefill-placement", "static", "--local-prefill-threshold", "0",
                                 "--cpu-num-blocks", "128", "--no-warmup", timeout_s=300, ray_address=ray_address)
    try:
        assert url, "".join(out)
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(out) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
