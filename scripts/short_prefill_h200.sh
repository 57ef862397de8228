#!/usr/bin/env bash
# Issue 35's short prefill passes on one H200: the GPU tests of the graphed pass (cluster/
# prefill_graph_runner.py against the eager one), bench_prefill's `mode: "short"` rows merged into a copy
# of loadtest/results/prefill_h200.json (OUT_DIR/prefill_h200.json: its other rows kept), then the TTFT
# cases (scripts/ttft_h200.sh -> OUT_DIR/ttft_h200.json) with what is left of BUDGET.
#
#   bash scripts/short_prefill_h200.sh OUT_DIR                # everything (more than one 10-minute call)
#   SKIP=ttft bash scripts/short_prefill_h200.sh OUT_DIR      # call 1: tests + short passes (~4 min)
#   SKIP=tests,short bash scripts/short_prefill_h200.sh OUT   # call 2: the TTFT cases (BUDGET 575 s)
#   DRY_RUN=1 bash scripts/short_prefill_h200.sh /tmp/x       # CPU: the CPU tests, the dry-run bench, ttft's dry run
#
# Knobs: SKIP (comma-separated: tests,short,ttft; ttft_h200.sh's 1b,8b pass through), BUDGET (575),
# TESTS_TIMEOUT (150), COMMIT (git's), and ttft_h200.sh's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T0=$(date +%s)
SKIP=",${SKIP:-},"
skip() { [[ $SKIP == *",$1,"* ]]; }
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
BUDGET=${BUDGET:-575}
# The source's commit, recorded in both results files: git's where this is a checkout, else COMMIT (the
# device machine gets a copy of the tree without .git: pass COMMIT=<hash> there).
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

if ! skip tests; then
  if [ -n "${DRY_RUN:-}" ]; then  # the CPU tests of the runner (the padded pass through the interpreter is CI's)
    SEL=(tests/cluster/engine/test_prefill_graph_runner.py -k "bucket or tiles or reason or staged or declined")
  else
    SEL=(-m gpu tests/cluster/engine/test_prefill_graph_runner.py tests/cluster/kernels/test_kernel_prefill_attention.py)
  fi
  timeout "${TESTS_TIMEOUT:-150}" $PY -m pytest -q -rfE -p no:cacheprovider "${SEL[@]}" > "$OUT/gpu_tests.log" 2>&1
  stamp "tests exit $? ($(tail -1 "$OUT/gpu_tests.log"))"
fi

if ! skip short; then
  cp loadtest/results/prefill_h200.json "$OUT/prefill_h200.json"
  if [ -n "${DRY_RUN:-}" ]; then
    ARGS=(--dry-run --reps 1)
  else
    ARGS=(--models llama-1b-shape,llama-8b-shape)
  fi
  timeout 300 $PY -m benchmarks.bench_prefill --mode short "${ARGS[@]}" --commit "$COMMIT" --out "$OUT/prefill_h200.json" \
    > "$OUT/bench_short.log" 2>&1
  stamp "short passes exit $?"
  grep " short " "$OUT/bench_short.log"
fi

if ! skip ttft; then
  left=$(( BUDGET - ($(date +%s) - T0) ))
  BUDGET=$left bash scripts/ttft_h200.sh "$OUT"
  stamp "ttft exit $?"
fi
stamp done
