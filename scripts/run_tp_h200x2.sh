#!/usr/bin/env bash
# Issue 26's two-GPU run (made by the multi-GPU issue; two H200s, one 10-minute device call: 200 s of
# tests + 360 s of benchmark at most): the two-GPU TP tests (one-shot all-reduce equals NCCL and replays
# in a graph, TP-2 engine equals the one-GPU engine on the Triton path, a TP-2 decode worker replaying
# CUDA graphs equals the engine), then benchmarks/bench_tp.py: the TP-2 decode step against its per-rank
# memory floor (8B shape at batch 1 / 64 with TP-1 rows beside, 70B shape at batch 1) and one-shot vs
# NCCL all-reduce per message size inside captured graphs. NVLink multicast stays off.
# Usage: scripts/run_tp_h200x2.sh OUT_DIR
#   writes (flat): gpu_tests_tp.log, bench_tp.log, tp_h200.json
# DRY_RUN=1 (CPU, about a minute): the same tests collected (the GPU ones skip) and bench_tp --dry-run
#   (gloo, the tiny shape) -> gpu_tests_tp_dry.log, bench_tp.log, tp_dry.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
TESTS="tests/cluster/distributed/test_tp_gpu.py"
if [[ ${DRY_RUN:-0} == 1 ]]; then
  LOG="$OUT/gpu_tests_tp_dry.log"
  timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider $TESTS > "$LOG" 2>&1
  echo "gpu tests (CPU: all skip): exit $? ($(tail -1 "$LOG"))"
  timeout 170 "$PY" -m benchmarks.bench_tp decode allreduce --dry-run --out "$OUT/tp_dry.json" > "$OUT/bench_tp.log" 2>&1
  rc=$?
  echo "bench_tp --dry-run: exit $rc"
  grep -v "^\s*$" "$OUT/bench_tp.log" | tail -5
  exit $rc
fi
LOG="$OUT/gpu_tests_tp.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$LOG" 2>&1
timeout 200 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider $TESTS >> "$LOG" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$LOG"))"
timeout 360 "$PY" -m benchmarks.bench_tp decode allreduce --tp 2 --out "$OUT/tp_h200.json" > "$OUT/bench_tp.log" 2>&1
echo "bench_tp: exit $?"
grep -v "^\s*$" "$OUT/bench_tp.log" | tail -40
