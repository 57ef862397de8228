#!/usr/bin/env bash
# Issues 18 and 25, run 4 (two H200s, about 5 minutes): worker faults with NCCL between the GPUs. One prefill worker
# on GPU 0 and one decode worker on GPU 1 (KV over NCCL, long prompts shipped layer-wise), greedy
# streams kept going while benchmarks/chaos.py kills the prefill or the decode worker every INTERVAL
# seconds (ray.kill with restart: Ray restarts the actor, it rejoins the transport under a new
# incarnation), kills single KV transfers mid-payload (NCCL: the pair's communicator aborted), wedges
# one (both sides give up at transfer_timeout_s) or cancels storms of long-prompt streams. Long prompts keep the prefill worker computing and shipping most of the time, so a kill
# lands mid-transfer; the JSON counts, per fault kind, the kills with KV in flight
# (`kills_mid_transfer`, `with_kv_in_flight`), the requests affected, finished exactly, hung, errors,
# blocks leaked, and seconds until the worker was back. The decode worker is the only one: while it
# restarts its requests wait (migration_wait_s) and new requests get 503, counted as http_5xx.
# Model: a Llama-3.2-1B-shaped random checkpoint in float32 (greedy text compared with the reference
# engine on GPU 0, same dtype).
# Targets (issue 25): hung, http_5xx beyond the sole decode worker's restarts, wrong text, blocks leaked: 0.
# Usage: scripts/run_faults_h200x2.sh OUT_DIR      -> OUT_DIR/chaos_h200x2.json, chaos_h200x2.log
#   DRY_RUN=1 scripts/run_faults_h200x2.sh /tmp/f  # CPU, the demo model, gloo, a short run: the load
#     ends once FAULTS_WANTED (default 1) faults were made and their victims are back (DURATION bounds it)
#   Knobs: DURATION INTERVAL TIMEOUT MODEL_DIR PY; FAULTS_WANTED (dry run only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
if [[ ${DRY_RUN:-0} == 1 ]]; then
  ARGS="--device cpu --duration-s ${DURATION:-40} --interval-s ${INTERVAL:-12} --streams 4 --max-tokens 12 \
    --long-prompt-words 60 --faults-wanted ${FAULTS_WANTED:-1}"
else
  MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-llama-1b-random-f32}
  [ -f "$MODEL_DIR/model.safetensors" ] || $PY -m benchmarks.make_model --shape llama-1b --dtype float32 --device cuda "$MODEL_DIR" || exit 1
  ARGS="--device cuda --dtype float32 --gpus-per-worker 1 --kv-memory-fraction 0.5 --reference-device cuda \
    --model $MODEL_DIR --duration-s ${DURATION:-180} --interval-s ${INTERVAL:-15} --streams 8 --max-tokens 32 \
    --long-prompt-words 1500 --deadline-s 240"
fi
# shellcheck disable=SC2086
# One decode worker: the faults that need two (rejoin_peer_death, simultaneous_restart) or take one away
# for good (restart_limit) are left out.
timeout ${TIMEOUT:-540} $PY -m benchmarks.chaos $ARGS --prefill-workers 1 --decode-workers 1 --sole-decode-kills \
  --faults prefill,decode,transfer,stuck_transfer,cancel_storm \
  --out "$OUT/chaos_h200x2.json" 2>&1 | tee "$OUT/chaos_h200x2.log" | grep -v "^\s*$" | tail -40
