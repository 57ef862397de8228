#!/usr/bin/env bash
# One H200, about 9 minutes: the GPU test suite (every test marked gpu), then the FP8 measurements of
# issue 27 (benchmarks/bench_fp8.py: GEMM paths, decode steps bf16/FP8 weights x bf16/FP8 KV, FP8
# prefill MFU, fp8_quality.json) and the structured-output step of issue 24 (bench_structured.py).
# Usage: scripts/run_fp8_structured_h200.sh OUT_DIR   (DRY_RUN=1: both benchmarks on CPU, no tests)
# Writes (flat): gpu_tests.log, decode_h200.json + prefill_h200.json (FP8 rows, source "bench_fp8"),
# fp8_quality.json, bench_fp8.log, structured_h200.json, bench_structured.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "${DRY_RUN:-}" ]; then
  DRY=(--dry-run)
else
  DRY=()
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true
  timeout "${TESTS_TIMEOUT:-230}" "$PY" -m pytest -q -rfE -m gpu --timeout 120 -p no:cacheprovider tests \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?: $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
timeout "${FP8_TIMEOUT:-240}" "$PY" -m benchmarks.bench_fp8 "${DRY[@]}" --out-dir "$OUT" > "$OUT/bench_fp8.log" 2>&1
echo "bench_fp8 exit $?"; tail -40 "$OUT/bench_fp8.log"
timeout "${STRUCTURED_TIMEOUT:-100}" "$PY" -m benchmarks.bench_structured "${DRY[@]}" --out "$OUT/structured_h200.json" \
  > "$OUT/bench_structured.log" 2>&1
echo "bench_structured exit $?"; tail -15 "$OUT/bench_structured.log"
