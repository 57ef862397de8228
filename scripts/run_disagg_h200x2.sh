#!/usr/bin/env bash
# Issues 15 and 25: disaggregation against colocation on two H200s (or one: GPUS=1).
# An 8B-shaped random bf16 model, Poisson arrivals, prompts of 128/512/2048 tokens, 128 output tokens,
# rates 2, 4, 6, 8, 12, 16, 24, 32, 48 req/s (the tight-SLO knee of colocation inside the range), at
# least 100 requests at the lowest rate (its TTFT p99 / p50 is judged on them), goodput under two SLO
# sets ({TTFT 1 s, TPOT 50 ms} and {300 ms, 15 ms}), server setups each started fresh (its start-up,
# warm-up included, happens before /ready):
#   adaptive     1 prefill + 1 decode worker, adaptive prefill placement (the default of `pdserve serve`)
#   static-1p1d  1 prefill + 1 decode worker, every prompt prefilled remotely (static, threshold 0)
#   colocated    2 decode workers, every prompt prefilled on its decode worker (no prefill worker)
#   planner      1P + 1D with the P:D planner on (fast settings, may go to 0P + 2D), under a load shift
#                (PHASES: prefill-heavy, then decode-heavy): goodput per phase, per 10 s, and before /
#                after its first role switch -> doc["shift"]["planner"]
# With GPUS=1 the 1P+1D setups share the one GPU (half each, KV by CUDA IPC) and colocated is one
# decode worker on the whole GPU.
#
# Usage: scripts/run_disagg_h200x2.sh OUT_DIR
#   writes OUT_DIR/disagg_vs_colocated.json (+ _records.jsonl, .png; *_h200x1* with GPUS=1),
#   OUT_DIR/serve_<setup>.log, OUT_DIR/disagg_timing.txt
# Time plan (2 GPUs): model ~40 s; per rate setup ~4 min (start-up ~60 s, warm-up ~5 s, 114 s of
# arrivals: 50 s at 2 req/s, 8 s at each other rate, + at most DRAIN s each to finish); planner ~4 min.
# All four setups (~17 min) exceed one 10-minute device call: run two calls, the second resuming the
# first's JSON (RESUME: copied into OUT_DIR first, rows merged, targets computed over all of them):
#   SETUPS=adaptive,static-1p1d scripts/run_disagg_h200x2.sh $OUT
#   SETUPS=colocated,planner RESUME=loadtest/results/disagg_vs_colocated.json scripts/run_disagg_h200x2.sh $OUT
# A rate that would start after the deadline (BUDGET_S from the start) is skipped and listed.
# Knobs: GPUS SETUPS RATES DURATION MIN_REQUESTS MIN_REQUESTS_LOWEST MAX_DURATION DRAIN BUDGET_S SHAPE
#        PROMPT_LENS OUTPUT_TOKENS PHASES PLANNER_FLAGS PORT EXTRA_SERVE_FLAGS RESUME;
#        DRY_RUN=1: CPU, the demo model, tiny load (the CI check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-loadtest/results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
GPUS=${GPUS:-2}
SETUPS=${SETUPS:-adaptive,static-1p1d,colocated,planner}
BUDGET_S=${BUDGET_S:-570}
# The planner, fast: a look every 2 s over 15 s of arrivals, two agreeing looks, no dwell, and it may
# move the only prefill worker (decode workers then prefill locally).
PLANNER_FLAGS=${PLANNER_FLAGS:---planner --planner-interval-s 2 --planner-window-s 15 --planner-confirmations 2 \
  --planner-min-dwell-s 0 --planner-min-prefill-workers 0 --planner-drain-timeout-s 15}
if [[ ${DRY_RUN:-0} == 1 ]]; then
  RATES=${RATES:-1,3}; DURATION=${DURATION:-3}; MIN_REQUESTS=${MIN_REQUESTS:-4}; MAX_DURATION=${MAX_DURATION:-4}
  MIN_REQUESTS_LOWEST=${MIN_REQUESTS_LOWEST:-5}
  DRAIN=${DRAIN:-20}; PROMPT_LENS=${PROMPT_LENS:-16,32,64}; OUTPUT_TOKENS=${OUTPUT_TOKENS:-8}
  PHASES=${PHASES:-prompts:2:64:4:3,outputs:3:16:16:4}
  PORT=${PORT:-$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
  MODEL_ARG=""  # the built-in demo model
  COMMON="--device cpu --max-num-seqs 16 --no-use-cuda-graph --cpu-num-blocks 512 --max-prefill-queue-s 1000"
  BUDGET_S=${DRY_BUDGET_S:-900}
else
  RATES=${RATES:-2,4,6,8,12,16,24,32,48}; DURATION=${DURATION:-8}; MIN_REQUESTS=${MIN_REQUESTS:-30}
  MIN_REQUESTS_LOWEST=${MIN_REQUESTS_LOWEST:-100}
  MAX_DURATION=${MAX_DURATION:-15}; DRAIN=${DRAIN:-6}; PROMPT_LENS=${PROMPT_LENS:-128,512,2048}
  PHASES=${PHASES:-prefill_heavy:4:2048:16:30,decode_heavy:12:128:256:120}
  OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}; PORT=${PORT:-8000}
  SHAPE=${SHAPE:-llama-8b}
  MODEL_DIR=${MODEL_DIR:-/tmp/pdserve-$SHAPE-random}
  MODEL_ARG=$MODEL_DIR
  COMMON="--device cuda --dtype bfloat16 --kv-memory-fraction 0.8 --max-model-len 8192 --max-num-seqs 128 --attention-backend triton"
fi
COMMON="$COMMON ${EXTRA_SERVE_FLAGS:-}"
if [[ $GPUS == 1 ]]; then
  RESULT="$OUT/disagg_vs_colocated_h200x1.json"
  PD_FLAGS="--prefill-workers 1 --decode-workers 1"  # two actors on one GPU: half each
  COLOCATED_FLAGS="--prefill-workers 0 --decode-workers 1"
else
  RESULT="$OUT/disagg_vs_colocated.json"
  PD_FLAGS="--prefill-workers 1 --decode-workers 1 --gpus-per-worker 1"
  COLOCATED_FLAGS="--prefill-workers 0 --decode-workers 2 --gpus-per-worker 1"
fi
[[ ${DRY_RUN:-0} == 1 ]] && PD_FLAGS="--prefill-workers 1 --decode-workers 1" && \
  COLOCATED_FLAGS="--prefill-workers 0 --decode-workers $GPUS"
TIMING="$OUT/disagg_timing.txt"
: > "$TIMING"
stamp() { echo "$(( $(date +%s) - START ))s $*" | tee -a "$TIMING"; }
left() { echo $(( START + BUDGET_S - $(date +%s) )); }

ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" 2>/dev/null; }

serve_and_bench() {  # setup-name, serve flags...
  local setup=$1; shift
  local load="--rates $RATES --duration $DURATION --min-requests $MIN_REQUESTS --min-requests-lowest $MIN_REQUESTS_LOWEST"
  load="$load --max-duration $MAX_DURATION --prompt-lens $PROMPT_LENS"
  [[ $setup == planner ]] && load="--phases $PHASES"
  if (( $(left) < 90 )); then stamp "$setup: skipped, $(left)s left of the budget"; return; fi
  stamp "$setup: starting the server"
  python3 -m deploy.cli serve $MODEL_ARG --port "$PORT" $COMMON "$@" > "$OUT/serve_$setup.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 600); do
    ready && break
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  if ready; then
    stamp "$setup: ready"
    # shellcheck disable=SC2086
    python3 -m benchmarks.bench_disagg --url "http://127.0.0.1:$PORT" --setup "$setup" $load --drain-s "$DRAIN" \
      --output-tokens "$OUTPUT_TOKENS" --deadline $(( START + BUDGET_S )) --out "$RESULT"
    stamp "$setup: measured"
  else
    stamp "$setup: server did not become ready"; tail -40 "$OUT/serve_$setup.log"
  fi
  kill -TERM $server 2>/dev/null; wait $server
  stamp "$setup: stopped"
}

rm -f "$RESULT" "${RESULT%.json}_records.jsonl"
if [[ -n ${RESUME:-} ]]; then  # a previous call's rows (and records) are merged with this call's
  if [[ -f $RESUME ]]; then
    cp "$RESUME" "$RESULT"
    [[ -f ${RESUME%.json}_records.jsonl ]] && cp "${RESUME%.json}_records.jsonl" "${RESULT%.json}_records.jsonl"
    stamp "resuming $RESUME"
  else
    stamp "RESUME=$RESUME does not exist: starting afresh"
  fi
fi
if [[ ${DRY_RUN:-0} != 1 ]]; then
  [ -f "$MODEL_DIR/model.safetensors" ] || python3 -m benchmarks.make_model --shape "$SHAPE" --device "${GEN_DEVICE:-cuda}" "$MODEL_DIR" || exit 1
  stamp "model ready"
fi
for setup in ${SETUPS//,/ }; do  # in the order given: a setup the budget cannot fit is skipped
  case $setup in
    adaptive) serve_and_bench adaptive $PD_FLAGS --prefill-placement adaptive ;;
    static-1p1d) serve_and_bench static-1p1d $PD_FLAGS --prefill-placement static --local-prefill-threshold 0 ;;
    colocated) serve_and_bench colocated $COLOCATED_FLAGS ;;
    planner) serve_and_bench planner $PD_FLAGS --prefill-placement adaptive $PLANNER_FLAGS ;;
    *) stamp "unknown setup $setup (adaptive, static-1p1d, colocated, planner)" ;;
  esac
done
[ -f "$RESULT" ] && python3 benchmarks/plot_disagg.py "$RESULT"
stamp "done"
exit 0
