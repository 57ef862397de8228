#!/usr/bin/env bash
# Issue 9 on two H200s: (1) NCCL KV transfer vs a plain send/recv baseline, (2) the full stack with a
# Llama-3.1-8B-shaped random bf16 model, 1 prefill GPU + 1 decode GPU (disaggregated) against the same
# two GPUs each running both phases (colocated: two decode workers that prefill locally), under a
# Poisson load with mixed prompt lengths.
# Usage: loadtest/run_disagg_h200x2.sh OUT_DIR   (knobs: STAGES, RATES, DURATION, SHAPE, PROMPT_LENS)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-loadtest/results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES=${STAGES:-nccl,disaggregated,colocated}
SHAPE=${SHAPE:-llama-8b}
MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-$SHAPE-random}
RATES=${RATES:-2,4,8}
DURATION=${DURATION:-20}
PROMPT_LENS=${PROMPT_LENS:-128,512,2048}
COMMON=${COMMON:-"--device cuda --dtype bfloat16 --gpus-per-worker 1 --kv-memory-fraction 0.8 --max-model-len 8192 --max-num-seqs 128 --attention-backend triton"}

if [[ $STAGES == *nccl* ]]; then
  python3 loadtest/bench_nccl.py --stages transfer --paths nccl --out "$OUT" || echo "bench_nccl failed"
fi

ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)" 2>/dev/null; }

serve_and_bench() {  # setup-name, extra serve flags
  local setup=$1; shift
  python3 -m cluster.app.cli serve "$MODEL_DIR" --port 8000 $COMMON "$@" > "$OUT/serve_$setup.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 400); do
    ready && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  if ready; then
    python3 -m loadtest.bench_disagg --url http://127.0.0.1:8000 --setup "$setup" --rates "$RATES" \
      --duration "$DURATION" --prompt-lens "$PROMPT_LENS" --output-tokens 128 --out "$OUT/disagg_vs_colocated.json"
  else
    echo "$setup: server did not become ready"; tail -40 "$OUT/serve_$setup.log"
  fi
  kill -TERM $server 2>/dev/null; wait $server
}

if [[ $STAGES == *disaggregated* || $STAGES == *colocated* ]]; then
  [ -f "$MODEL_DIR/model.safetensors" ] || python3 -m loadtest.make_model --shape "$SHAPE" --device "${GEN_DEVICE:-cuda}" "$MODEL_DIR" || exit 1
fi
[[ $STAGES == *disaggregated* ]] && serve_and_bench disaggregated --prefill-workers 1 --decode-workers 1 --local-prefill-threshold 0
[[ $STAGES == *colocated* ]] && serve_and_bench colocated --prefill-workers 0 --decode-workers 2
[ -f "$OUT/disagg_vs_colocated.json" ] && python3 loadtest/plot_disagg.py "$OUT/disagg_vs_colocated.json"
exit 0
