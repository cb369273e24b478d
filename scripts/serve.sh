#!/usr/bin/env bash
# Install what is missing into .venv and the embedded default model, then serve
# model_repository with tritonserver, and the OpenAI-compatible API next to it.
# Ports: HTTP_PORT, GRPC_PORT, METRICS_PORT (8000/8001/8002), OPENAI_PORT (9000; 0: no OpenAI
# API). OPENAI_API_KEY set: the OpenAI API wants it as a bearer token; SERVED_MODEL_NAME: the
# name it serves the model under (default: the checkpoint folder's). Extra arguments go to
# tritonserver. SIGTERM or SIGINT stop both; the OpenAI API stops when tritonserver does.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
grpc_port="${GRPC_PORT:-8001}" metrics_port="${METRICS_PORT:-8002}"
openai_port="${OPENAI_PORT:-9000}"
triton_args=(--model-repository="$PWD/model_repository" --http-port="${HTTP_PORT:-8000}"
  --grpc-port="$grpc_port" --metrics-port="$metrics_port" --disable-auto-complete-config "$@")
if [ "$openai_port" = 0 ]; then
  run_tritonserver "${triton_args[@]}"  # execs: this script's pid is the server's
fi

(run_tritonserver "${triton_args[@]}") &
server=$!
openai_args=(--triton-url "127.0.0.1:$grpc_port" --port "$openai_port"
  --metrics-url "http://127.0.0.1:$metrics_port/metrics")
[ -n "${SERVED_MODEL_NAME:-}" ] && openai_args+=(--served-model-name "$SERVED_MODEL_NAME")
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m minisgl_backend.openai_server \
  "${openai_args[@]}" &
openai=$!
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT HUP
echo "serve.sh: OpenAI-compatible API on http://localhost:$openai_port/v1 (ready when" \
  "http://localhost:$openai_port/health answers 200)"
status=0
while kill -0 "$server" 2>/dev/null; do  # a trapped signal interrupts wait: wait again
  wait "$server" && status=0 || status=$?
done
kill -TERM "$openai" 2>/dev/null || true
wait "$openai" 2>/dev/null || true
exit "$status"
