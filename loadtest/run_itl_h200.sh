#!/usr/bin/env bash
# ITL per decode batch size on one H200: `pdserve serve` (1 prefill + 1 decode worker sharing the GPU)
# with a Llama-3.2-1B-shaped random-weight bf16 model, under the concurrency steps 1..128.
#
# Writes loadtest/results/itl_h200.json (rows: batch_size, itl_p50/p90/p99_ms, ttft_p50_ms, tpot_p50_ms,
# server_step_ms, server_bucket, server_padded_rows, tokens_per_s, stalls, requests, ...) and
# loadtest/results/itl_h200.png; raw Locust CSVs and records under loadtest/results/itl_h200/.
#
# Knobs (environment): MODEL_DIR, STEPS, STEP_DURATION, WARMUP, PROMPT_TOKENS, OUTPUT_TOKENS,
# STALL_TIMEOUT, PROCESSES, SERVE_ARGS (extra `pdserve serve` flags, space-separated).
# Total time: about len(STEPS) * STEP_DURATION + model/cluster start-up (~8 * 40 s + 1-2 min).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-llama-1b-random}
STEPS=${STEPS:-1,2,4,8,16,32,64,128}
STEP_DURATION=${STEP_DURATION:-40}
WARMUP=${WARMUP:-12}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
# Long enough that a user spends most of its time decoding (the batch stays near the user count),
# short enough for many requests per step.
OUTPUT_TOKENS=${OUTPUT_TOKENS:-256}
STALL_TIMEOUT=${STALL_TIMEOUT:-10}
PROCESSES=${PROCESSES:-4}
# Two actors share the GPU (each sizes its KV pool from its half); Triton paged attention and
# CUDA graphs for decode; the context is capped so nothing sizes for 128k tokens.
SERVE_ARGS=${SERVE_ARGS:---device cuda --dtype bfloat16 --gpus-per-worker 0.5 --max-model-len 4096 --max-num-seqs 128 --attention-backend triton}

if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
  python -m loadtest.make_model --shape llama-1b "$MODEL_DIR"
fi

serve_flags=()
for a in $SERVE_ARGS; do serve_flags+=("--serve-arg=$a"); done

python -m loadtest.run --start-cluster --model "$MODEL_DIR" --prefill-workers 1 --decode-workers 1 \
  "${serve_flags[@]}" \
  --steps "$STEPS" --step-duration "$STEP_DURATION" --warmup "$WARMUP" \
  --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --stall-timeout "$STALL_TIMEOUT" \
  --processes "$PROCESSES" --stats-interval 0.25 \
  --out loadtest/results/itl_h200 --summary loadtest/results/itl_h200.json --plot loadtest/results/itl_h200.png \
  --title "pdserve on 1x H200: Llama-3.2-1B shape, bf16, prompt $PROMPT_TOKENS / output $OUTPUT_TOKENS tokens"
