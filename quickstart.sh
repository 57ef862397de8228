#!/usr/bin/env bash
# Sets pdserve up, serves the built-in demo model on a local Ray cluster (one prefill and one decode
# worker, KV moved between them), answers a chat completion and a streamed completion over HTTP,
# prints what /metrics saw of the disaggregation (where each prompt was prefilled, the KV moved),
# then shuts the cluster down. `./quickstart.sh --keep-serving` leaves it running on :8000.
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

pdserve serve --prefill-workers 1 --decode-workers 1 --prefill-placement static --port "$PORT" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "pdserve serve exited" >&2; exit 1; }
  sleep 1
done

echo "(The demo model's weights are random, so its text is noise, often bytes that are not UTF-8 (shown"
echo " as U+FFFD). Serve a real model with: pdserve serve meta-llama/Llama-3.2-1B-Instruct)"
echo "--- POST /v1/chat/completions"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "pdserve-demo", "max_tokens": 24, "temperature": 0,
  "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}'
echo
echo "--- POST /v1/completions (stream)"
curl -sSN "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "pdserve-demo", "prompt": "Once upon a time", "max_tokens": 8, "stream": true}'
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
