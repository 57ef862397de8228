#!/usr/bin/env bash
# Issue 28 on one H200 in one call (at most BUDGET = 575 s): the GPU test suite, then every measurement of the
# issue, into OUT_DIR (flat), a summary table last.
#
#   bash loadtest/run_issue28_h200.sh OUT_DIR
#   DRY_RUN=1 bash loadtest/run_issue28_h200.sh /tmp/x   # CPU, the demo model: checks the pipeline
#
# Timeline (servers start in the background while the GPU tests run; they sit idle, their KV pools
# small, until their turn, so nothing measured shares the GPU with other work):
#   t=0     servers: 1B (1 prefill + 1 decode worker, 4 API servers: ITL, TTFT) and 8B (1P + 1D:
#           prefix caching); their random checkpoints are written on the CPU first
#           foreground: pytest -m gpu (the whole GPU suite)                         -> gpu_tests.log
#   then    bench_decode: 8B and 1B shapes, batch 1/8/64/256, graph vs eager, kernels per step,
#           top-k/top-p and features vs greedy, graph-vs-eager kernel diff        -> decode_h200.json
#           bench_transfer: same-GPU path, what the served path pays               -> transfer_h200.json
#           ITL: Locust 1..256 users on the 1B server, STEP_DURATION s a step      -> itl_h200.json
#           TTFT: the ITL report at 1/4/16 users, a plain client, the server's own -> ttft_h200.json
#           prefix caching on the 8B server: multi-turn, hits vs no shared block   -> prefix_cache_h200.json
# Knobs: BUDGET (575), STEP_DURATION (18), WARMUP (6), STEPS, TESTS_TIMEOUT (260), DECODE_STEPS (24), PREFIX_SHAPE
# (llama-8b), SKIP (comma-separated: tests,decode,transfer,itl,ttft,prefix).
# The prefix server's router keeps the KV index (prefix_aware policies; one worker of each role, so
# placement is the same): the prefill cost model then counts only the tokens each path computes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T0=$(date +%s)
SKIP=",${SKIP:-},"
skip() { [[ $SKIP == *",$1,"* ]]; }
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# The whole script ends within BUDGET s (one 600 s device call): a stage gets at most its own limit
# and never more than what is left less RESERVE s (stopping the servers, the summary). A stage cut
# short this way leaves what it wrote so far, and the summary reports its targets as not measured.
BUDGET=${BUDGET:-575}; RESERVE=${RESERVE:-30}
limit() { local want=$1 left=$(( BUDGET - RESERVE - ($(date +%s) - T0) )); (( left < want )) && want=$left; (( want < 1 )) && want=1; echo "$want"; }

if [ -n "${DRY_RUN:-}" ]; then
  ITL_MODEL=$($PY -c 'from cluster.model.demo import ensure_demo_model as e; print(e())')
  PREFIX_MODEL=$ITL_MODEL
  ITL_SERVE="--device cpu --no-use-cuda-graph --max-model-len 1024 --api-servers 2"
  PREFIX_SERVE="--device cpu --dtype float32 --cpu-num-blocks 1024 --max-model-len 4096 --max-num-seqs 16 --enable-prefix-caching"
  STEPS=${STEPS:-1,2}; STEP_DURATION=${STEP_DURATION:-8}; WARMUP=${WARMUP:-3}; OUTPUT_TOKENS=32; PROCESSES=1
  TTFT_USERS=1,2; CLIENT_SECONDS=4
  PREFIX_WORKLOAD="--sessions 4 --turns 3 --system-tokens 256 --output-tokens 8 --ttft-slo-s 5 --tpot-slo-s 1"
  DECODE_ARGS=(--dry-run --no-hf); TRANSFER_ARGS=(--dry-run)
  skip tests || SKIP="$SKIP,tests,"
else
  ITL_MODEL=${ITL_MODEL:-/tmp/pdserve-llama-1b-random}
  PREFIX_SHAPE=${PREFIX_SHAPE:-llama-8b}
  PREFIX_MODEL=${PREFIX_MODEL:-/tmp/pdserve-$PREFIX_SHAPE-random}
  # Each worker's KV pool is small (a tenth / a sixth of its half): both servers and the benchmarks fit.
  ITL_SERVE="--device cuda --dtype bfloat16 --gpus-per-worker 0.5 --kv-memory-fraction 0.12 --max-model-len 4096 \
    --max-num-seqs 256 --attention-backend triton --api-servers 4"
  PREFIX_SERVE="--device cuda --dtype bfloat16 --gpus-per-worker 0.5 --kv-memory-fraction 0.18 --max-model-len 8192 \
    --max-num-seqs 128 --attention-backend triton --local-prefill-threshold 0 --enable-prefix-caching \
    --prefill-policy prefix_aware --decode-policy prefix_aware"
  STEPS=${STEPS:-1,2,4,8,16,32,64,128,256}; STEP_DURATION=${STEP_DURATION:-18}; WARMUP=${WARMUP:-6}
  OUTPUT_TOKENS=256; PROCESSES=8; TTFT_USERS=1,4,16; CLIENT_SECONDS=${CLIENT_SECONDS:-6}
  PREFIX_WORKLOAD="--sessions 12 --turns 5 --system-tokens 1500 --output-tokens 32"
  DECODE_ARGS=(--batch-sizes 1,8,64,256 --steps "${DECODE_STEPS:-24}" --no-hf); TRANSFER_ARGS=(--sizes 128,256,1024,4096)
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true
fi

# -- servers, in the background ----------------------------------------------------------------------
declare -A PID
serve() {  # name model_dir shape "serve args": its random checkpoint first, then `pdserve serve` (log: serve_<name>.log)
  local name=$1 model=$2 shape=$3 args=$4
  ( if [ ! -f "$model/config.json" ]; then
      $PY -m loadtest.make_model --shape "$shape" --device "${GEN_DEVICE:-cuda}" "$model" > "$OUT/make_$name.log" 2>&1
    fi
    # shellcheck disable=SC2086
    exec $PY -m deploy.cli serve "$model" --prefill-workers 1 --decode-workers 1 --host 127.0.0.1 --port 0 $args \
      > "$OUT/serve_$name.log" 2>&1 ) &
  PID[$name]=$!
}
wait_url() {  # name timeout_s -> prints the URL once /ready answers
  $PY - "$OUT/serve_$1.log" "$2" <<'PYEOF'
import re, sys, time, urllib.request
log, deadline = sys.argv[1], time.time() + float(sys.argv[2])
while time.time() < deadline:
    try:
        m = re.search(r"serving \S+ at (http://\S+)/v1", open(log, errors="replace").read())
        if m:
            urllib.request.urlopen(m.group(1) + "/ready", timeout=2)
            print(m.group(1))
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(1)
PYEOF
}
stop_server() {  # name: SIGTERM (pdserve drains and stops what it started), then SIGKILL after 20 s
  local pid=${PID[$1]:-}
  [ -z "$pid" ] && return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$pid" 2>/dev/null
  unset "PID[$1]"
}
cleanup() { for n in "${!PID[@]}"; do stop_server "$n"; done; }
trap cleanup EXIT
need_itl=1; { skip itl && skip ttft; } && need_itl=0
need_prefix=1; skip prefix && need_prefix=0
[ $need_itl = 1 ] && serve itl "$ITL_MODEL" llama-1b "$ITL_SERVE"
# (On CPU the two servers would share two cores with the tests: the prefix one starts after the ITL one.)
[ $need_prefix = 1 ] && [ -z "${DRY_RUN:-}" ] && serve prefix "$PREFIX_MODEL" "$PREFIX_SHAPE" "$PREFIX_SERVE"
stamp "servers starting"

# -- 1. the GPU test suite ------------------------------------------------------------------------------
if ! skip tests; then
  timeout "$(limit "${TESTS_TIMEOUT:-260}")" $PY -m pytest -q -rfE -m gpu --timeout 150 -p no:cacheprovider tests \
    --deselect tests/cluster/kernels/test_kernels_compile_for_sm90.py::test_kernels_compile_for_sm90_without_spilling \
    > "$OUT/gpu_tests.log" 2>&1
  stamp "gpu tests exit $?: $(tail -1 "$OUT/gpu_tests.log")"
fi

# -- 2. decode steps and 3. transfers, with the servers up and idle (nothing else on the GPU) ---------
[ $need_itl = 1 ] && { ITL_URL=$(wait_url itl "$(limit 400)") || stamp "the ITL server is not up"; }
[ $need_prefix = 1 ] && [ -z "${DRY_RUN:-}" ] && { PREFIX_URL=$(wait_url prefix "$(limit 400)") || stamp "the prefix server is not up"; }
stamp "servers ready: itl ${ITL_URL:-none}, prefix ${PREFIX_URL:-later}"
if ! skip decode; then
  # bench_decode merges into its --out file, keeping other benchmarks' rows (bench_fp8's): start from
  # the committed file, so that OUT/decode_h200.json can replace it as it is.
  [ -f "$OUT/decode_h200.json" ] || cp loadtest/results/decode_h200.json "$OUT/decode_h200.json"
  timeout "$(limit "${DECODE_TIMEOUT:-200}")" $PY -m loadtest.bench_decode "${DECODE_ARGS[@]}" --out "$OUT/decode_h200.json" \
    > "$OUT/decode_h200.log" 2>&1
  stamp "bench_decode exit $?"
fi
if ! skip transfer; then
  timeout "$(limit "${TRANSFER_TIMEOUT:-90}")" $PY loadtest/bench_transfer.py "${TRANSFER_ARGS[@]}" --no-prefill --out "$OUT" \
    > "$OUT/transfer_h200.log" 2>&1
  stamp "bench_transfer exit $?"
fi

# -- 4. ITL and 5. TTFT on the 1B server ------------------------------------------------------------------
if [ $need_itl = 1 ] && [ -n "${ITL_URL:-}" ]; then
  if ! skip itl; then
    n_steps=$(echo "$STEPS" | tr ',' '\n' | wc -l)
    timeout "$(limit $(( n_steps * STEP_DURATION + 150 )))" $PY -m loadtest.run --url "$ITL_URL" --steps "$STEPS" \
      --step-duration "$STEP_DURATION" --warmup "$WARMUP" --prompt-tokens 128 --output-tokens "$OUTPUT_TOKENS" \
      --stall-timeout 10 --processes "$PROCESSES" --stats-interval 0.25 --out "$OUT/itl_raw" \
      --summary "$OUT/itl_h200.json" --plot "$OUT/itl_h200.png" \
      --title "pdserve on 1x H200: Llama-3.2-1B shape, bf16, 1P+1D, prompt 128 / output $OUTPUT_TOKENS tokens" \
      > "$OUT/itl_h200.log" 2>&1
    stamp "ITL exit $?"
  fi
  if ! skip ttft; then
    REPORT=()
    [ -f "$OUT/itl_h200.json" ] && REPORT=(--report-summary "$OUT/itl_h200.json")
    timeout "$(limit 240)" $PY -m loadtest.bench_ttft --url "$ITL_URL" --users "$TTFT_USERS" "${REPORT[@]}" \
      --client-seconds "$CLIENT_SECONDS" --step-duration "$STEP_DURATION" --warmup "$WARMUP" \
      --output-tokens "$OUTPUT_TOKENS" --out "$OUT/ttft_h200.json" > "$OUT/ttft_h200.log" 2>&1
    stamp "TTFT exit $?"
  fi
elif [ $need_itl = 1 ]; then
  stamp "the ITL server did not come up: tail of serve_itl.log"; tail -30 "$OUT/serve_itl.log"
fi
stop_server itl

# -- 6. prefix caching ------------------------------------------------------------------------------------
if [ $need_prefix = 1 ]; then
  if [ -n "${DRY_RUN:-}" ]; then
    serve prefix "$PREFIX_MODEL" llama-tiny "$PREFIX_SERVE"
    PREFIX_URL=$(wait_url prefix "$(limit 400)")
  fi
  if [ -n "${PREFIX_URL:-}" ]; then
    rm -f "$OUT/prefix_cache_h200.json"
    for cache in on uncached; do
      # shellcheck disable=SC2086
      timeout "$(limit 200)" $PY -m loadtest.bench_prefix_cache --url "$PREFIX_URL" --setup one_gpu --cache $cache \
        --workloads multi_turn --rates 4 $PREFIX_WORKLOAD --out "$OUT/prefix_cache_h200.json" \
        >> "$OUT/prefix_cache_h200.log" 2>&1
      stamp "prefix cache ($cache) exit $?"
    done
    $PY -m loadtest.prefix_cache_report "$OUT/prefix_cache_h200.json" >> "$OUT/prefix_cache_h200.log" 2>&1
  else
    stamp "the prefix server did not come up: tail of serve_prefix.log"; tail -30 "$OUT/serve_prefix.log"
  fi
fi
cleanup
trap - EXIT
stamp "done"
$PY -m loadtest.issue28_summary "$OUT" --skip "$SKIP"
