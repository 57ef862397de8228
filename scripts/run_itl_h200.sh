#!/usr/bin/env bash
# ITL per decode batch size on one H200: `pdserve serve` (1 prefill + 1 decode worker sharing the GPU,
# 4 API-server processes) with a Llama-3.2-1B-shaped random-weight bf16 model, under the Locust
# concurrency steps 1..256. About 9 x 36 s of load + ~1.5 min of start-up: under 9 minutes.
#
#   bash scripts/run_itl_h200.sh [OUT_DIR]          # OUT_DIR default: loadtest/results
#   DRY_RUN=1 bash scripts/run_itl_h200.sh /tmp/x   # the same pipeline on CPU with the demo model, ~1 min
#
# Writes OUT_DIR/itl_h200.json (rows: batch_size, itl_p50/p90/p99_ms, ttft_p50_ms, tpot_p50_ms,
# server_step_ms, server_bucket, server_padded_rows, tokens_per_s, stalls, requests, ...) and
# OUT_DIR/itl_h200.png; raw Locust CSVs, client events, server step records and serve.log under
# OUT_DIR/itl_h200/. Look at: itl_p50_over_step per row (target <= 1.10 at every batch size) and
# checks.itl_bs64_over_bs1 (target <= 2) in the JSON; stalls/errors must be 0.
#
# Knobs (environment): MODEL_DIR, STEPS, STEP_DURATION, WARMUP, PROMPT_TOKENS, OUTPUT_TOKENS,
# STALL_TIMEOUT, PROCESSES, API_SERVERS, SERVE_ARGS (extra `pdserve serve` flags, space-separated),
# MPS=1 (the two workers' processes share the GPU through an MPS daemon: scripts/gpu_sharing.sh; the
# summary's config.gpu_sharing says which sharing ran).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-loadtest/results}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_sharing.sh
. scripts/gpu_sharing.sh
mps_start
trap mps_stop EXIT

if [ "${DRY_RUN:-0}" = 1 ]; then
  MODEL_DIR=${MODEL_DIR:-$(python -c 'from cluster.model.demo import ensure_demo_model as e; print(e())')}
  STEPS=${STEPS:-1,2}
  STEP_DURATION=${STEP_DURATION:-10}
  WARMUP=${WARMUP:-4}
  OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
  PROCESSES=${PROCESSES:-1}
  API_SERVERS=${API_SERVERS:-2}
  SERVE_ARGS=${SERVE_ARGS:---device cpu --no-use-cuda-graph --max-model-len 1024}
fi
MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-llama-1b-random}
STEPS=${STEPS:-1,2,4,8,16,32,64,128,256}
STEP_DURATION=${STEP_DURATION:-36}
WARMUP=${WARMUP:-12}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
# Long enough that a user spends most of its time decoding (the batch stays near the user count),
# short enough for many requests per step.
OUTPUT_TOKENS=${OUTPUT_TOKENS:-256}
STALL_TIMEOUT=${STALL_TIMEOUT:-10}
# Locust needs about one process per ~8k streamed events/s: 256 users at ~3 ms steps stream ~85k/s.
PROCESSES=${PROCESSES:-8}
# One H200's token rate (up to ~90k tokens/s at batch 256) over four gateway processes.
API_SERVERS=${API_SERVERS:-4}
# Two actors share the GPU (each sizes its KV pool from its half); Triton paged attention and
# CUDA graphs for decode; the context is capped so nothing sizes for 128k tokens.
SERVE_ARGS=${SERVE_ARGS:---device cuda --dtype bfloat16 --gpus-per-worker 0.5 --max-model-len 4096 --max-num-seqs 256 --attention-backend triton}

if [ ! -f "$MODEL_DIR/config.json" ]; then
  python -m benchmarks.make_model --shape llama-1b "$MODEL_DIR"
fi

serve_flags=("--serve-arg=--api-servers" "--serve-arg=$API_SERVERS")
for a in $SERVE_ARGS; do serve_flags+=("--serve-arg=$a"); done

python -m loadtest.run --start-cluster --model "$MODEL_DIR" --prefill-workers 1 --decode-workers 1 \
  "${serve_flags[@]}" \
  --steps "$STEPS" --step-duration "$STEP_DURATION" --warmup "$WARMUP" \
  --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --stall-timeout "$STALL_TIMEOUT" \
  --processes "$PROCESSES" --stats-interval 0.25 \
  --out "$OUT/itl_h200" --summary "$OUT/itl_h200.json" --plot "$OUT/itl_h200.png" \
  --title "pdserve on 1x H200: Llama-3.2-1B shape, bf16, prompt $PROMPT_TOKENS / output $OUTPUT_TOKENS tokens, $API_SERVERS API servers, GPU shared $SHARING"
