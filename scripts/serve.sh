#!/usr/bin/env bash
# Install what is missing into .venv and the embedded default model, then serve
# model_repository with tritonserver. Ports: HTTP_PORT, GRPC_PORT, METRICS_PORT (8000/8001/8002).
# Extra arguments go to tritonserver.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
run_tritonserver --model-repository="$PWD/model_repository" \
  --http-port="${HTTP_PORT:-8000}" --grpc-port="${GRPC_PORT:-8001}" \
  --metrics-port="${METRICS_PORT:-8002}" --disable-auto-complete-config "$@"
