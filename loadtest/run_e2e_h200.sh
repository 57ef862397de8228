#!/usr/bin/env bash
# Issues 5 and 6 on one H200: `pdserve serve` with a Llama-3.2-1B-shaped random bf16 model, one
# prefill and one decode actor sharing the GPU (same-GPU KV path), then
#   1. loadtest/bench_e2e.py  -> e2e_h200.json (HTTP ITL at batch 1 vs server step, TTFT parts)
#   2. the Locust step shape 1..128 -> itl_h200.json + itl_h200.png
# Usage: loadtest/run_e2e_h200.sh OUT_DIR   (knobs: SHAPE, SERVE_ARGS, STEPS, STEP_DURATION, WARMUP)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-loadtest/results}
mkdir -p "$OUT"
SHAPE=${SHAPE:-llama-1b}
MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-$SHAPE-random}
PORT=${PORT:-8000}
STEPS=${STEPS:-1,2,4,8,16,32,64,128}
STEP_DURATION=${STEP_DURATION:-30}
WARMUP=${WARMUP:-10}
GEN_DEVICE=${GEN_DEVICE:-cuda}
SERVE_ARGS=${SERVE_ARGS:---device cuda --dtype bfloat16 --gpus-per-worker 0.5 --kv-memory-fraction 0.4 --max-model-len 4096 --max-num-seqs 128 --attention-backend triton}

ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" 2>/dev/null; }
RAW=${RAW:-/tmp/pdserve-itl-raw}
[ -f "$MODEL_DIR/model.safetensors" ] || python3 -m loadtest.make_model --shape "$SHAPE" --device "$GEN_DEVICE" "$MODEL_DIR" || exit 1
# shellcheck disable=SC2086
python3 -m deploy.cli serve "$MODEL_DIR" --prefill-workers 1 --decode-workers 1 --port "$PORT" $SERVE_ARGS \
  > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT
for _ in $(seq 1 300); do
  ready && break
  kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -50 "$OUT/serve.log"; exit 1; }
  sleep 1
done
ready || { echo "server not ready"; tail -50 "$OUT/serve.log"; exit 1; }
echo "server ready"

[ -n "${SKIP_E2E:-}" ] || python3 -m loadtest.bench_e2e --url "http://127.0.0.1:$PORT" --out "$OUT/e2e_h200.json" ${E2E_ARGS:-}

python3 -m loadtest.run --url "http://127.0.0.1:$PORT" --steps "$STEPS" --step-duration "$STEP_DURATION" \
  --warmup "$WARMUP" --prompt-tokens 128 --output-tokens 256 --stall-timeout 10 --processes ${PROCESSES:-4} \
  --stats-interval 0.25 --out "$RAW" --summary "$OUT/itl_h200.json" --plot "$OUT/itl_h200.png" \
  --title "pdserve on 1x H200: Llama-3.2-1B shape, bf16, prompt 128 / output 256 tokens" ${LT_ARGS:-}
echo "loadtest exit $?"
# Raw Locust CSVs and per-event records, packed (the summary JSON and plot sit beside it).
tar -czf "$OUT/itl_raw.tgz" -C "$(dirname "$RAW")" "$(basename "$RAW")"
