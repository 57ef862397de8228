#!/usr/bin/env bash
# Issue 17: prefix caching on and off under shared-prefix traffic (benchmarks/bench_prefix_cache.py),
# with a Llama-3.1-8B-shaped random bf16 model.
#   one_gpu        one H200: a prefill and a decode worker sharing the GPU (KV over CUDA IPC)
#   disaggregated  two H200s: prefill on one, decode on the other (KV over NCCL); rows carry the
#                  KV bytes transferred
# Each setup serves twice (caching on, then off) and writes rows to OUT_DIR/prefix_cache_h200.json.
# Usage: scripts/run_prefix_cache.sh OUT_DIR [one_gpu|disaggregated]
#   DRY_RUN=1: the same on CPU with a tiny model and a small workload (checks the script end to end).
#   Knobs: CACHES ("on off"), RATES, WORKLOADS, SESSIONS, TURNS, SYSTEM_TOKENS, FEW_SHOT_REQUESTS, SHAPE,
#   SERVE_ARGS, BENCH_ARGS, MPS=1 (one_gpu: the two workers' processes share the GPU through an MPS
#   daemon, scripts/gpu_sharing.sh; a dry run refuses it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-loadtest/results}
SETUP=${2:-one_gpu}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_sharing.sh
. scripts/gpu_sharing.sh
mps_start
trap mps_stop EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
PORT=${PORT:-8000}
WORKLOADS=${WORKLOADS:-multi_turn,few_shot}
if [ -n "${DRY_RUN:-}" ]; then
  SHAPE=${SHAPE:-llama-tiny}
  GEN_DEVICE=cpu
  BASE="--device cpu --dtype float32 --cpu-num-blocks 1024 --max-model-len 4096 --max-num-seqs 16"
  RATES=${RATES:-2}
  WORKLOAD_ARGS="--sessions ${SESSIONS:-4} --turns ${TURNS:-3} --system-tokens ${SYSTEM_TOKENS:-256} \
    --few-shot-requests ${FEW_SHOT_REQUESTS:-8} --template-tokens 256 --output-tokens 8 --ttft-slo-s 5 --tpot-slo-s 1"
else
  SHAPE=${SHAPE:-llama-8b}
  GEN_DEVICE=${GEN_DEVICE:-cuda}
  BASE="--device cuda --dtype bfloat16 --max-model-len 8192 --max-num-seqs 128 --attention-backend triton"
  RATES=${RATES:-4}
  WORKLOAD_ARGS="--sessions ${SESSIONS:-32} --turns ${TURNS:-6} --system-tokens ${SYSTEM_TOKENS:-1500} \
    --few-shot-requests ${FEW_SHOT_REQUESTS:-96}"
fi
case $SETUP in
  one_gpu) TOPOLOGY="--prefill-workers 1 --decode-workers 1 --local-prefill-threshold 0"
           [ -z "${DRY_RUN:-}" ] && TOPOLOGY="$TOPOLOGY --gpus-per-worker 0.5 --kv-memory-fraction 0.4" ;;
  disaggregated) TOPOLOGY="--prefill-workers 1 --decode-workers 1 --local-prefill-threshold 0"
           [ -z "${DRY_RUN:-}" ] && TOPOLOGY="$TOPOLOGY --gpus-per-worker 1 --kv-memory-fraction 0.8" ;;
  *) echo "unknown setup $SETUP (one_gpu | disaggregated)"; exit 2 ;;
esac
MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-$SHAPE-random${DRY_RUN:+-f32}}
[ -f "$MODEL_DIR/model.safetensors" ] || $PY -m benchmarks.make_model --shape "$SHAPE" --device "$GEN_DEVICE" \
  ${DRY_RUN:+--dtype float32} "$MODEL_DIR" || exit 1

ready() { $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" 2>/dev/null; }

serve_and_bench() {  # cache on|off
  local cache=$1 flag=--enable-prefix-caching
  [ "$cache" = off ] && flag=--no-enable-prefix-caching
  # shellcheck disable=SC2086
  $PY -m deploy.cli serve "$MODEL_DIR" --port "$PORT" $BASE $TOPOLOGY $flag ${SERVE_ARGS:-} \
    > "$OUT/serve_prefix_${SETUP}_$cache.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 400); do
    ready && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  if ready; then
    # shellcheck disable=SC2086
    $PY -m benchmarks.bench_prefix_cache --url "http://127.0.0.1:$PORT" --setup "$SETUP" --cache "$cache" \
      --workloads "$WORKLOADS" --rates "$RATES" $WORKLOAD_ARGS ${BENCH_ARGS:-} --out "$OUT/prefix_cache_h200.json" \
      || echo "bench ($SETUP, cache $cache) failed"
  else
    echo "$SETUP cache $cache: server did not become ready"; tail -40 "$OUT/serve_prefix_${SETUP}_$cache.log"
  fi
  kill -TERM $server 2>/dev/null; wait $server
}

for cache in ${CACHES:-on off}; do
  serve_and_bench "$cache"
done
[ -f "$OUT/prefix_cache_h200.json" ] && $PY -m benchmarks.prefix_cache_report "$OUT/prefix_cache_h200.json"
exit 0
