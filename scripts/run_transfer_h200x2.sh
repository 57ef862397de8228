#!/usr/bin/env bash
# Issue 25, run 1 (two H200s, about 7 minutes; one 10-minute device call: 240 s + 330 s at most): the
# GPU transport tests (fused copy kernel, the staged payload's CUDA code over a loopback group, NCCL
# exact for every slot size, a peer dying mid-transfer on either side), then benchmarks/bench_nccl.py:
# NCCL transfers 128..8192 tokens against a plain send/recv of one buffer (default 32 MiB slots, no
# lead, 16 and 64 MiB slots), decode step p50/p99 with and without incoming transfers, TTFT of a
# 2048-token 8B prompt with layer-wise shipping off and on, and the staging kernel alone.
# Usage: scripts/run_transfer_h200x2.sh OUT_DIR
#   writes (flat): gpu_tests_x2.log, bench_nccl.log, nccl_h200x2.json, nccl_h200x2.png
# GPUS=1 (one H200, about 2 minutes): the same GPU tests (the two-GPU ones skip) and the staging stage
#   alone -> gpu_tests_x1.log, staging_h200.json
# DRY_RUN=1 (CPU, under a minute): the tests collected (GPU ones skip) and bench_nccl --dry-run with
#   every stage -> nccl_dry.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
GPUS=${GPUS:-2}
TESTS="tests/cluster/transport/test_gpu_transfer.py tests/cluster/transport/test_block_copy.py"
if [[ ${DRY_RUN:-0} == 1 ]]; then
  LOG="$OUT/gpu_tests_dry.log"
  timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider $TESTS > "$LOG" 2>&1
  echo "gpu tests (CPU: all skip): exit $? ($(tail -1 "$LOG"))"
  timeout 170 "$PY" benchmarks/bench_nccl.py --dry-run --stages transfer,stall,ttft,staging --name nccl_dry \
    --out "$OUT" > "$OUT/bench_nccl.log" 2>&1
  rc=$?
  echo "bench_nccl --dry-run: exit $rc"
  grep -v "^\s*$" "$OUT/bench_nccl.log" | tail -5
  exit $rc
fi
LOG="$OUT/gpu_tests_x$GPUS.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$LOG" 2>&1
timeout 240 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider $TESTS >> "$LOG" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$LOG"))"
if [[ $GPUS == 1 ]]; then
  timeout 240 "$PY" benchmarks/bench_nccl.py --stages staging --name staging_h200 --out "$OUT" > "$OUT/bench_staging.log" 2>&1
  echo "bench_nccl --stages staging: exit $?"
  grep -v "^\s*$" "$OUT/bench_staging.log" | tail -25
  exit 0
fi
timeout 330 "$PY" benchmarks/bench_nccl.py --stages transfer,stall,ttft,staging --out "$OUT" > "$OUT/bench_nccl.log" 2>&1
echo "bench_nccl: exit $?"
grep -v "^\s*$" "$OUT/bench_nccl.log" | tail -40
