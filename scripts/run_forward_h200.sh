#!/usr/bin/env bash
# Issue 13 on one H200, in about 8 minutes: the GPU tests of the fused kernels, the model on them and the
# graph runner, then the prefill and decode benchmarks on random-weight bf16 Llama-3.1-8B / 3.2-1B shapes.
# Usage: scripts/run_forward_h200.sh OUT_DIR   (knobs: BATCH_SIZES, STEPS, HF_BATCH_SIZES, *_TIMEOUT;
#        DRY_RUN=1 checks the script on CPU: no tests, both benchmarks with --dry-run)
# Writes (flat): gpu_tests.log, prefill_h200.json, prefill_h200.log, decode_h200.json, decode_h200.png,
# decode_h200.log. Each stage has its own time limit, so one stuck stage leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
if [ -n "${DRY_RUN:-}" ]; then
  DRY=(--dry-run); DECODE_EXTRA=(--batch-sizes 1,4)
else
  DRY=(); DECODE_EXTRA=(--batch-sizes "${BATCH_SIZES:-1,8,64,256}" --steps "${STEPS:-30}"
                        --hf-batch-sizes "${HF_BATCH_SIZES:-1,64}" --compile --compile-models llama-1b-shape)
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true

  # 1. Correctness on the GPU (also compiles the Triton kernels the benchmarks reuse from the cache).
  timeout "${TESTS_TIMEOUT:-230}" "$PY" -m pytest -q -rfE --timeout 120 -p no:cacheprovider \
    tests/cluster/kernels tests/cluster/test_fused_model.py tests/cluster/attention/test_triton_decode.py \
    tests/decode_worker/test_graph_runner_gpu.py \
    tests/cluster/test_hf_equivalence.py::test_greedy_tokens_equal_hf_generate_with_the_fused_kernels_on_gpu \
    --deselect tests/cluster/kernels/test_kernels_compile_for_sm90.py::test_kernels_compile_for_sm90_without_spilling \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?: $(tail -1 "$OUT/gpu_tests.log")"
fi

# 2. Prefill: 32x128, 8x512, 2x2048, 1x4096 tokens; MFU against the measured bf16 matmul rate.
timeout "${PREFILL_TIMEOUT:-90}" "$PY" -m benchmarks.bench_prefill "${DRY[@]}" --out "$OUT/prefill_h200.json" \
  > "$OUT/prefill_h200.log" 2>&1
echo "prefill exit $?"; grep -E "MFU|matmul" "$OUT/prefill_h200.log"

# 3. Decode: graph (default path) vs eager, kernels per step, sampled vs greedy, host time, compile, HF.
timeout "${DECODE_TIMEOUT:-250}" "$PY" -m benchmarks.bench_decode "${DRY[@]}" "${DECODE_EXTRA[@]}" \
  --out "$OUT/decode_h200.json" > "$OUT/decode_h200.log" 2>&1
echo "decode exit $?"; grep -E "graph step|batch: gpu|compiled|host parts" "$OUT/decode_h200.log"
