#!/usr/bin/env bash
# Issue 35's TTFT measurement on one H200 in one call (at most BUDGET = 575 s): the 1B and then the 8B
# shape served alone on the GPU (1 prefill + 1 decode worker, every prompt prefilled on the prefill
# worker, prefix caching on), benchmarks.ttft_cases against each -> OUT_DIR/ttft_h200.json, rows with
# the issue's fields (benchmarks/ttft_cases.py ROW_FIELDS), a table last.
#
#   bash scripts/ttft_h200.sh OUT_DIR                 # one device call: bash scripts/ttft_h200.sh $OUT
#   DRY_RUN=1 bash scripts/ttft_h200.sh /tmp/x        # CPU, the demo model, small cases: checks the pipeline
#
# Cases, per shape: 1 user with 128-, 512- and 2048-token unique prompts, and 1 user with 2048-token
# prompts of which 1920 are a cached prefix; the 1B shape also at the ITL run's levels (1..256 users,
# 128-token prompts, 256 output tokens). prefill_h200.json's `mode: "short"` rows and the GPU tests of
# the graphed prefill pass: scripts/short_prefill_h200.sh, which runs this script last.
# Knobs: BUDGET (575), CASE_SECONDS (8), LEVEL_SECONDS (8), LEVELS, LEVELS_LIMIT (150: the levels stage's
# share of the budget), SKIP (comma-separated: 1b,8b), COMMIT (git's; the device's copy has no .git),
# MPS=1: the two workers' processes share the GPU through an MPS daemon (scripts/gpu_sharing.sh); the
# header's `gpu_sharing` says which sharing ran. DISPATCH (zmq): the router's dispatch to the prefill
# worker, `--prefill-dispatch` (zmq: a signed frame; ray: a Ray actor call). USERS_PER_PROCESS (16; 1 in a
# dry run): ttft_cases' `--users-per-process`, the most users one client process (one event loop) reads, so
# a levels run can check whether the client's own loop is what lags (64 users: 4 processes at 16, 16 at 4).
# SKIP=cases: no 1-user cases, the levels alone (a levels-only pass, e.g. SKIP=8b,cases LEVELS=1,64).
# OVERLAP (off): the prefill worker's `--prefill-overlap` (on / auto: a short pass launches while the one ahead is
# on the GPU; off: one pass at a time).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T0=$(date +%s)
SKIP_ARG=${SKIP:-}
SKIP=",${SKIP:-},"
skip() { [[ $SKIP == *",$1,"* ]]; }
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
BUDGET=${BUDGET:-575}; RESERVE=${RESERVE:-25}
limit() { local want=$1 left=$(( BUDGET - RESERVE - ($(date +%s) - T0) )); (( left < want )) && want=$left; (( want < 1 )) && want=1; echo "$want"; }
RESULT="$OUT/ttft_h200.json"
rm -f "$RESULT"
# shellcheck source=scripts/gpu_sharing.sh
. scripts/gpu_sharing.sh
mps_start
trap mps_stop EXIT  # replaced below by one that stops the server first
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

# Prompt ids are drawn below VOCAB: the random-weight shapes use the demo tokenizer (benchmarks/make_model.py).
VOCAB=500
if [ -n "${DRY_RUN:-}" ]; then
  MODEL_1B=$($PY -c 'from cluster.model.demo import ensure_demo_model as e; print(e())'); MODEL_8B=$MODEL_1B
  SERVE="--device cpu --dtype float32 --cpu-num-blocks 1024 --max-model-len 1024 --api-servers 1"
  USERS_PER_PROCESS=${USERS_PER_PROCESS:-1}  # 2 users: 2 processes
  CASES="1x32,1x64,1x96c64"; LEVELS=${LEVELS:-1,2}; CASE_ARGS=(--requests 4 --output-tokens 4 --level-output-tokens 8)
  CASE_SECONDS=${CASE_SECONDS:-4}; LEVEL_SECONDS=${LEVEL_SECONDS:-3}
  SKIP="$SKIP,8b,"
else
  MODEL_1B=${MODEL_1B:-/tmp/pdserve-llama-1b-random}; MODEL_8B=${MODEL_8B:-/tmp/pdserve-llama-8b-random}
  SERVE="--device cuda --dtype bfloat16 --gpus-per-worker 0.5 --kv-memory-fraction 0.2 --max-model-len 4096 \
    --max-num-seqs 256 --attention-backend triton --api-servers 4"
  USERS_PER_PROCESS=${USERS_PER_PROCESS:-16}
  CASES="1x128,1x512,1x2048,1x2048c1920"; LEVELS=${LEVELS:-1,2,4,8,16,32,64,128,256}; CASE_ARGS=()
  CASE_SECONDS=${CASE_SECONDS:-8}; LEVEL_SECONDS=${LEVEL_SECONDS:-8}
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true
fi
DISPATCH=${DISPATCH:-zmq}
CASE_ARGS+=(--users-per-process "$USERS_PER_PROCESS")
OVERLAP=${OVERLAP:-off}
SERVE="$SERVE --prefill-placement static --local-prefill-threshold 0 --enable-prefix-caching --prefill-dispatch $DISPATCH \
  --prefill-overlap $OVERLAP"
# The file's header (benchmarks.ttft_cases appends the rows and keeps it): this run's command, with the
# knobs it ran under, the commit, and what served.
$PY - "$RESULT" "$COMMIT" "SKIP=$SKIP_ARG BUDGET=$BUDGET CASE_SECONDS=$CASE_SECONDS LEVEL_SECONDS=$LEVEL_SECONDS \
LEVELS=$LEVELS LEVELS_LIMIT=${LEVELS_LIMIT:-150} DISPATCH=$DISPATCH OVERLAP=$OVERLAP USERS_PER_PROCESS=$USERS_PER_PROCESS${DRY_RUN:+ DRY_RUN=1}${MPS:+ MPS=1} bash scripts/ttft_h200.sh $1" "$SERVE" "$SHARING" <<'PYEOF'
import json, sys
path, commit, command, serve, sharing = sys.argv[1:]
json.dump({"command": command, "commit": commit, "serve_args": " ".join(serve.split()), "gpu_sharing": sharing,
           "rows": [], "errors": []}, open(path, "w"), indent=1)
PYEOF

PID=""
serve() {  # name model_dir shape: its random checkpoint first, then `pdserve serve` (log: serve_<name>.log)
  local name=$1 model=$2 shape=$3
  if [ ! -f "$model/config.json" ]; then
    timeout "$(limit 120)" $PY -m benchmarks.make_model --shape "$shape" --device "${GEN_DEVICE:-cuda}" "$model" \
      > "$OUT/make_$name.log" 2>&1 || { stamp "make_model $shape failed"; return 1; }
  fi
  # shellcheck disable=SC2086
  $PY -m deploy.cli serve "$model" --prefill-workers 1 --decode-workers 1 --host 127.0.0.1 --port 0 $SERVE \
    > "$OUT/serve_$name.log" 2>&1 &
  PID=$!
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
stop_server() {  # SIGTERM (pdserve drains and stops what it started), then SIGKILL after 20 s
  [ -z "$PID" ] && return 0
  kill -TERM "$PID" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$PID" 2>/dev/null
  PID=""
}
trap 'stop_server; mps_stop' EXIT

measure() {  # name model_dir shape row_name levels
  local name=$1 model=$2 shape=$3 row=$4 levels=$5 url
  serve "$name" "$model" "$shape" || return 0
  url=$(wait_url "$name" "$(limit 240)") || { stamp "the $name server is not up"; stop_server; return 0; }
  stamp "$name server ready at $url"
  if ! skip cases; then
    timeout "$(limit 150)" $PY -m benchmarks.ttft_cases --url "$url" --model-name "$row" --vocab-size "$VOCAB" \
      --cases "$CASES" --seconds "$CASE_SECONDS" "${CASE_ARGS[@]}" --out "$RESULT" > "$OUT/ttft_cases_$name.log" 2>&1
    stamp "$name cases exit $?"
  fi
  if [ -n "$levels" ]; then
    timeout "$(limit "${LEVELS_LIMIT:-150}")" $PY -m benchmarks.ttft_cases --url "$url" --model-name "$row" --vocab-size "$VOCAB" \
      --levels "$levels" --seconds "$LEVEL_SECONDS" "${CASE_ARGS[@]}" --out "$RESULT" > "$OUT/ttft_levels_$name.log" 2>&1
    stamp "$name levels exit $?"
  fi
  stop_server
}

skip 1b || measure 1b "$MODEL_1B" llama-1b llama-1b-shape "$LEVELS"
skip 8b || measure 8b "$MODEL_8B" llama-8b llama-8b-shape ""

$PY - "$RESULT" <<'PYEOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError):
    sys.exit("no rows written")
f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
print(f"{'model':16} {'users':>5} {'prompt':>6} {'cached':>6} {'client p50':>10} {'p99':>7} {'server p50':>10} "
      f"{'floor':>7} {'p50/floor':>9}")
for r in rows:
    ratio = r["client_ttft_p50_ms"] / r["floor_ms"] if r["client_ttft_p50_ms"] and r["floor_ms"] else None
    print(f"{r['model']:16} {r['users']:5d} {r['prompt_tokens']:6d} {r['cached_tokens']:6d} "
          f"{f(r['client_ttft_p50_ms']):>10} {f(r['client_ttft_p99_ms']):>7} {f(r['server_ttft_p50_ms']):>10} "
          f"{f(r['floor_ms']):>7} {'-' if ratio is None else f'{ratio:.2f}':>9}")
    print(f"    parts p50: {r['server_parts_p50_ms']}")
PYEOF
stamp "done"
