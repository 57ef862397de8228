#!/usr/bin/env bash
# Cross-check of the Locust report against NVIDIA aiperf: one `pdserve serve` (the ITL run's setup:
# 1B shape on one H200, 1 prefill + 1 decode worker, 4 API servers), then at each concurrency the
# Locust run (`python -m loadtest.run`) and aiperf against that same server, one after the other.
#
#   bash scripts/run_aiperf_h200.sh OUT_DIR            # ~7 minutes on one H200
#   DRY_RUN=1 bash scripts/run_aiperf_h200.sh /tmp/x   # CPU, demo model, ~2 minutes
#
# aiperf runs from its own virtual environment (its dependencies are not pdserve's), installed
# offline from AIPERF_WHEELS (default .aiperf_whl: `pip download aiperf -d .aiperf_whl` for Python
# 3.12 x86-64, carried with the tree), or taken as is from AIPERF_VENV if that already has it.
# Writes OUT_DIR/locust-c<N>/ (summary.json ...), OUT_DIR/aiperf-c<N>/ (profile_export_aiperf.json
# ...), OUT_DIR/serve.log and OUT_DIR/aiperf_vs_locust.json (benchmarks/compare_aiperf.py): per
# concurrency, Locust's chunk-gap ITL p50 vs aiperf's inter_chunk_latency p50, Locust's TPOT p50 vs
# aiperf's inter_token_latency p50, and TTFT p50 of both. Target: within 10 % pairwise.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: run_aiperf_h200.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ "${DRY_RUN:-0}" = 1 ]; then
  MODEL_DIR=${MODEL_DIR:-$(python -c 'from cluster.model.demo import ensure_demo_model as e; print(e())')}
  CONCURRENCY=${CONCURRENCY:-1,4}
  DURATION=${DURATION:-12}
  WARMUP=${WARMUP:-4}
  OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
  PROCESSES=${PROCESSES:-1}
  API_SERVERS=${API_SERVERS:-2}
  SERVE_ARGS=${SERVE_ARGS:---device cpu --no-use-cuda-graph --max-model-len 1024}
fi
MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-llama-1b-random}
CONCURRENCY=${CONCURRENCY:-1,16,64,256}
DURATION=${DURATION:-30}
WARMUP=${WARMUP:-8}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-256}
PROCESSES=${PROCESSES:-8}
API_SERVERS=${API_SERVERS:-4}
SERVE_ARGS=${SERVE_ARGS:---device cuda --dtype bfloat16 --gpus-per-worker 0.5 --max-model-len 4096 --max-num-seqs 256 --attention-backend triton}
AIPERF_VENV=${AIPERF_VENV:-/tmp/aiperf-venv}
AIPERF_WHEELS=${AIPERF_WHEELS:-.aiperf_whl}

# -- aiperf in its own environment, offline ------------------------------------------------------
if [ ! -x "$AIPERF_VENV/bin/aiperf" ]; then
  python3 -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/pip" install -q --no-index --find-links "$AIPERF_WHEELS" aiperf
fi
# NOTE: not HF_HUB_OFFLINE=1: aiperf 0.13 then resolves even a local --tokenizer directory as a hub
# repo id and fails; a local directory loads without the network anyway.

# -- the server ------------------------------------------------------------------------------------
if [ ! -f "$MODEL_DIR/config.json" ]; then
  python -m benchmarks.make_model --shape llama-1b "$MODEL_DIR"
fi
# shellcheck disable=SC2086
python -m deploy.cli serve "$MODEL_DIR" --prefill-workers 1 --decode-workers 1 --host 127.0.0.1 --port 0 \
  --api-servers "$API_SERVERS" $SERVE_ARGS > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 1 600); do
  URL=$(grep -oE 'serving \S+ at http://[0-9.:]+' "$OUT/serve.log" | grep -oE 'http://[0-9.:]+' | head -1 || true)
  if [ -n "$URL" ] && curl -sf "$URL/ready" > /dev/null; then break; fi
  kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/serve.log"; exit 1; }
  sleep 1
done
[ -n "$URL" ] || { echo "server not ready; see $OUT/serve.log"; exit 1; }
MODEL=$(curl -s "$URL/v1/models" | python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "server $MODEL at $URL"

# -- each concurrency: Locust, then aiperf ----------------------------------------------------------
for C in ${CONCURRENCY//,/ }; do
  python -m loadtest.run --url "$URL" --steps "$C" --step-duration "$((DURATION + WARMUP))" --warmup "$WARMUP" \
    --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --processes "$PROCESSES" \
    --stats-interval 0.25 --out "$OUT/locust-c$C" > "$OUT/locust-c$C.log" 2>&1 || true
  tail -3 "$OUT/locust-c$C.log"
  "$AIPERF_VENV/bin/aiperf" profile --model "$MODEL" --tokenizer "$MODEL_DIR" --url "$URL" \
    --endpoint-type completions --streaming --concurrency "$C" --benchmark-duration "$DURATION" \
    --warmup-request-count "$C" --use-server-token-count --ui-type none \
    --synthetic-input-tokens-mean "$PROMPT_TOKENS" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --artifact-dir "$OUT/aiperf-c$C" > "$OUT/aiperf-c$C.log" 2>&1 || tail -20 "$OUT/aiperf-c$C.log"
done
python -m benchmarks.compare_aiperf "$OUT"
