#!/usr/bin/env bash
# Issue 14 on two H200s (about 6 minutes): the GPU transport tests (fused copy kernel, NCCL exact under
# every plan, a peer dying mid-transfer on either side), then loadtest/bench_nccl.py: NCCL transfers
# 128..8192 tokens against a plain send/recv of one buffer, decode step p50/p99 with and without
# incoming transfers, TTFT of a 2048-token 8B prompt with layer-wise shipping off and on.
# Usage: loadtest/run_transfer_h200x2.sh OUT_DIR
# Writes (flat): gpu_tests_x2.log, bench_nccl.log, nccl_h200x2.json, nccl_h200x2.png
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu_tests_x2.log" 2>&1
timeout 240 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests/cluster/transport/test_gpu_transfer.py \
  tests/cluster/transport/test_block_copy.py >> "$OUT/gpu_tests_x2.log" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$OUT/gpu_tests_x2.log"))"
timeout 360 "$PY" loadtest/bench_nccl.py --out "$OUT" > "$OUT/bench_nccl.log" 2>&1
echo "bench_nccl: exit $?"
grep -v "^\s*$" "$OUT/bench_nccl.log" | tail -40
