#!/usr/bin/env bash
# Issue 14 on one H200 (about 4 minutes): the GPU transport tests that need one GPU (fused copy kernel,
# same-GPU transfer exact), then benchmarks/bench_transfer.py: the same-GPU path (CUDA IPC, fused copy,
# event doorbell) 128..8192 tokens against the device copy bandwidth, and the 8B prefill times for the
# TTFT share.
# Usage: scripts/run_transfer_h200.sh OUT_DIR
# Writes (flat): gpu_tests_x1.log, bench_transfer.log, transfer_h200.json, transfer_h200.png
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
timeout 150 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests/cluster/transport/test_gpu_transfer.py \
  tests/cluster/transport/test_block_copy.py > "$OUT/gpu_tests_x1.log" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$OUT/gpu_tests_x1.log"))"
timeout 300 "$PY" benchmarks/bench_transfer.py --paths same_gpu --out "$OUT" > "$OUT/bench_transfer.log" 2>&1
echo "bench_transfer: exit $?"
grep -v "^\s*$" "$OUT/bench_transfer.log" | tail -20
