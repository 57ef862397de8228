"""The multi-GPU run scripts of issue 25, each in its DRY_RUN=1 form on CPU (short): they must run at
HEAD and write what loadtest/results/MULTI_GPU_RUNS.md says they write, so that the GPU runs are one
command each. The disagg, prefix-cache and faults scripts start servers on the run's Ray (marker
`cluster`: the one-at-a-time stream, tests/conftest.py); the transfer and TP scripts spawn gloo ranks
and no Ray, so they run beside it, in the other stream, as the transport tests do."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the run scripts in DRY_RUN form: a minute each

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, *args: str, timeout: float, **env: str) -> str:
    e = {**os.environ, "DRY_RUN": "1", "PY": sys.executable, "PYTHONPATH": str(ROOT), **env}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"  # python3 = this venv's
    r = subprocess.run(["bash", str(ROOT / "scripts" / script), str(out), *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def test_transfer_script_dry_run(tmp_path):
    """run_transfer_h200x2.sh: bench_nccl with every stage over gloo, tiny shapes."""
    _run("run_transfer_h200x2.sh", tmp_path, timeout=240)
    doc = json.loads((tmp_path / "nccl_dry.json").read_text())
    assert doc["rows"] and all(r["exact"] for r in doc["rows"]), doc["rows"]
    assert {r["prompt_tokens"] for r in doc["rows"]} == {32, 256} and all(r["launches"] >= 1 for r in doc["rows"])
    assert [r["mode"] for r in doc["decode_stall"]["rows"]] == ["none", "transfers", "transfers_layerwise"]
    stall = doc["decode_stall"]
    assert stall["prefill_failures"] == 0 and stall["decode_error"] is None, stall  # every transfer landed
    assert stall["decode_transport"]["transfers"] == sum(r["transfers"] for r in stall["rows"]) > 0
    assert [r["layerwise"] for r in doc["ttft_overlap"]["rows"]] == [False, True]
    assert all(not r["errors"] and r["reps"] == 4 for r in doc["ttft_overlap"]["rows"])  # 2 rounds x 2 reps
    stg = doc["staging"]["rows"]
    assert stg and all(r["exact"] for r in stg) and max(r["launches"] for r in stg) > 1
    assert set(doc["targets"]) >= {"of_baseline_ge_0.8_from_2048", "le_0.3ms_at_128", "decode_p99_le_1.1x"}


@pytest.mark.cluster  # a server on the run's Ray
def test_disagg_script_dry_run_planner_load_shift(tmp_path, ray_address):
    """run_disagg_h200x2.sh, its planner setup: a server with the planner on, a two-phase load shift,
    goodput per phase in doc["shift"]."""
    # The arrivals are seeded (bench_disagg's Random(0)): these two 1-s phases send 2 and 5 requests.
    _run("run_disagg_h200x2.sh", tmp_path, timeout=240, RAY_ADDRESS=ray_address, SETUPS="planner",
         PHASES="prompts:4:64:4:1,outputs:4:16:16:1", EXTRA_SERVE_FLAGS="--no-warmup")  # (as the prefix cache's)
    doc = json.loads((tmp_path / "disagg_vs_colocated.json").read_text())
    shift = doc["shift"]["planner"]
    assert [r["phase"] for r in shift["per_phase"]] == ["prompts", "prompts", "outputs", "outputs"]  # 2 SLO sets
    assert all(r["failed"] == 0 and r["requests"] > 0 for r in shift["per_phase"]), shift["per_phase"]
    assert shift["samples"] and "role_switches" in shift["samples"][0]


def test_disagg_script_resumes_a_previous_calls_rows(tmp_path):
    """The disagg run is two device calls: the second (RESUME) keeps the first's rows. Checked without a
    server: a setup name the script does not know runs nothing and leaves the resumed file as it was."""
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"rows": [{"setup": "adaptive", "slo": "tight", "request_rate": 2.0}]}))
    out = _run("run_disagg_h200x2.sh", tmp_path / "out", timeout=60, SETUPS="none", RESUME=str(prev))
    assert "resuming" in out and "unknown setup none" in out
    assert json.loads((tmp_path / "out" / "disagg_vs_colocated.json").read_text()) == json.loads(prev.read_text())


@pytest.mark.cluster  # a server on the run's Ray
@pytest.mark.parametrize("setup", ["disaggregated"])
def test_prefix_cache_script_dry_run(tmp_path, ray_address, setup):
    """run_prefix_cache.sh OUT disaggregated (short: caching on only, one small workload): a row of
    that setup, with the KV bytes transferred."""
    # --no-warmup: the script's run is the subject, not the server's warm-up (test_serve_command.py's)
    _run("run_prefix_cache.sh", tmp_path, setup, timeout=300, RAY_ADDRESS=ray_address, CACHES="on",
         WORKLOADS="multi_turn", SESSIONS="2", TURNS="2", SERVE_ARGS="--no-warmup")
    rows = json.loads((tmp_path / "prefix_cache_h200.json").read_text())["rows"]
    assert [(r["setup"], r["cache"], r["workload"]) for r in rows] == [(setup, "on", "multi_turn")], rows
    assert rows[0]["failed"] == 0 and "kv_transfer_bytes" in rows[0]


@pytest.mark.cluster  # a server on the run's Ray
def test_faults_script_dry_run(tmp_path, ray_address):
    """run_faults_h200x2.sh: kills under load (gloo on CPU) -> chaos_h200x2.json. The dry run's load ends
    once one fault was made and its victim is back (FAULTS_WANTED=1); DURATION only bounds it."""
    _run("run_faults_h200x2.sh", tmp_path, timeout=240, RAY_ADDRESS=ray_address, DURATION="60", INTERVAL="1")
    summary = json.loads((tmp_path / "chaos_h200x2.json").read_text())["summary"]
    # One fault of the script's kinds (prefill, decode, transfer, stuck_transfer, cancel_storm), drawn at random.
    assert sum(k["injected"] for k in summary["by_fault"].values()) >= 1, summary
    # (http_5xx is not 0 here: while the sole decode worker restarts, new requests get 503 by design)
    assert summary["hung"] == summary["mismatched"] == summary["blocks_leaked"] == 0, summary


def test_tp_script_dry_run(tmp_path):
    """run_tp_h200x2.sh (issue 26): the two-GPU TP tests collected (they skip on CPU) and bench_tp
    --dry-run: decode rows of TP 1 and TP 2 against their floors, all-reduce rows over gloo."""
    out = _run("run_tp_h200x2.sh", tmp_path, timeout=300)
    assert "gpu tests (CPU: all skip): exit 0" in out, out
    rows = json.loads((tmp_path / "tp_dry.json").read_text())["rows"]
    decode = [r for r in rows if r["bench"] == "decode"]
    assert {r["tp"] for r in decode} == {1, 2} and all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in decode)
    assert [r for r in rows if r["bench"] == "allreduce"] and all(r["correct"] for r in rows if r["bench"] == "allreduce")
