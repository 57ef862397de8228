"""Every Triton kernel compiles for sm_90 (H100/H200) on a machine without a GPU, and keeps its tile in
registers: the tiles and warp counts were chosen from these resource reports, and a change that
makes a kernel spill (or stops it compiling: type errors the interpreter lets through) fails here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # a minute of compiling in a subprocess
def test_kernels_compile_for_sm90_without_spilling():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        import triton.backends.nvidia  # noqa: F401  (ptxas and cuobjdump ship with it)
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = {r["kernel"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(reports) == 39, sorted(reports)
    for name, r in reports.items():
        # The prefill attention's 128 x 128 tile at head_dim 128 has a few registers on the stack; every
        # other kernel none.
        allowed = 64 if name.startswith("prefill_attention/128") else 0
        assert r["stack"] <= allowed, r
        if name.startswith(("prefill_attention", "fp8_gemm")):
            assert r["wgmma"], r  # Hopper's warpgroup MMA, not the older mma.sync path
        if name.startswith("fp8_gemm/"):
            assert r["fast_widen"], r  # e4m3 -> bf16 by the integer trick, not the quarter-rate conversions
        if name.startswith("rotary_kv"):
            # FP fusion off: x1 * c - x2 * s rounds each product, as torch does (one bf16 fma would not)
            assert not r["bf16_fma"], r
