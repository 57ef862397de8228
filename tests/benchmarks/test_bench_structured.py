"""bench_structured's dry run on CPU (the GPU run is the same code at batch 64 on the 8B shape): every
measurement is taken and written, and the synthetic vocabulary is a byte-level one of the model's size."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_structured import schema_with_fields, synthetic_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_measurement(tmp_path):
    out = tmp_path / "structured.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_structured", "--dry-run", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert [(s["mask_kernel"], s["constrained_rows"]) for s in res["step"]] == [(False, 0), (True, 0), (True, 1),
                                                                              (True, 4)]
    assert all(s["gpu_step_ms"] > 0 and s["host_prepare_us"] > 0 for s in res["step"])
    assert res["step"][0]["vs_unconstrained"] == 1.0
    loops = {s["constrained_rows"]: s for s in res["loop"] if s["mask_kernel"]}
    assert loops[1]["constrained_row_tokens_per_s"] > 0 and loops[1]["free_row_tokens_per_s"] > 0
    assert loops[4]["free_row_tokens_per_s"] is None
    c = res["compile"]
    assert c["fields"] == 50 and c["compile_s"] > 0 and c["grammar_for_cached_s"] < c["grammar_for_first_s"]
    assert set(res["met"]) == {"unconstrained_rows", "fully_constrained"}


def test_the_synthetic_vocabulary():
    tok = synthetic_tokenizer(2048, 2000)
    vocab = tok.get_vocab()
    assert len(vocab) == 2048 and max(vocab.values()) == 2047
    assert tok.eos_token_id == 2001 and tok.bos_token_id == 2000 and len(tok.all_special_ids) == 48
    assert tok.decode(tok.convert_tokens_to_ids(["{", "Ġ1"])) == "{ 1"
    assert len(schema_with_fields(50)["required"]) == 50
