#!/usr/bin/env bash
# Sets pdserve up, serves the built-in demo model on a local Ray cluster (one prefill and one decode
# worker, KV moved between them), answers a chat completion and a streamed completion over HTTP,
# then shuts the cluster down. `./quickstart.sh --keep-serving` leaves it running on :8000.
set -euo pipefail
cd "$(dirname "$0")"
PORT=${PORT:-8000}
if ! python3 -c "import torch" 2>/dev/null; then
  pip install -q torch==2.13.0  # the CPU build; a GPU host keeps its own CUDA torch
fi
pip install -q -e .

pdserve serve --prefill-workers 1 --decode-workers 1 --port "$PORT" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "pdserve serve exited" >&2; exit 1; }
  sleep 1
done

echo "--- POST /v1/chat/completions"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "pdserve-demo", "max_tokens": 24, "temperature": 0,
  "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}'
echo
echo "--- POST /v1/completions (stream)"
curl -sSN "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "pdserve-demo", "prompt": "Once upon a time", "max_tokens": 8, "stream": true}'
echo
if [ "${1:-}" = "--keep-serving" ]; then
  echo "serving on http://127.0.0.1:$PORT/v1 (Ctrl-C stops)"
  wait $SERVER
fi
