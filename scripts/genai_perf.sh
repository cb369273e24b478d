#!/usr/bin/env bash
# Profile the `ensemble` model with genai-perf (kserve gRPC endpoint, TensorRT-LLM backend
# conventions, streaming) and print genai-perf's table.
#
#   scripts/genai_perf.sh [-u HOST:GRPC_PORT] [-- EXTRA_GENAI_PERF_ARGS ...]
#
# With -u (or GRPC_URL) it profiles the server there; without, it starts its own tritonserver
# (scripts/serve.sh, on free ports), waits until the ensemble is ready, and stops it at the end.
# genai-perf (pinned in scripts/client_venv.py) lives in its own venv, .client-venvs/genai-perf,
# made on first use: its dependencies change numpy and transformers. It runs the real
# perf_analyzer that scripts/triton_env.sh puts on PATH (the `perf-analyzer` package genai-perf
# depends on is an empty placeholder).
#
# Environment (defaults: CPU-sized):
#   CONCURRENCY=2            concurrent streams
#   REQUESTS=16              requests measured (--request-count)
#   INPUT_TOKENS=64          synthetic prompt length, mean (stddev 0)
#   OUTPUT_TOKENS=32         max_tokens per request
#   DETERMINISTIC=1          1: min_length = max_tokens too, so every answer has OUTPUT_TOKENS
#   WARMUP=0                 warmup requests; 0 or at least CONCURRENCY (perf_analyzer 2.51
#                            never ends with a warmup count between 1 and the concurrency)
#   TOKENIZER=models/SmolLM2-135M-Instruct   a local HF folder (the default is a hub name)
#   ARTIFACT_DIR=            keep genai-perf's artifacts (inputs, profile export, CSV) there
#   READY_TIMEOUT=600        seconds to wait for a server this script starts
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

GRPC_URL="${GRPC_URL:-}"
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -u|--url) GRPC_URL="${2:?-u needs HOST:PORT}"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "genai_perf.sh: bad argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
CONCURRENCY="${CONCURRENCY:-2}"
REQUESTS="${REQUESTS:-16}"
INPUT_TOKENS="${INPUT_TOKENS:-64}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-32}"
WARMUP="${WARMUP:-0}"
for n in "$CONCURRENCY" "$REQUESTS" "$INPUT_TOKENS" "$OUTPUT_TOKENS"; do
  case "$n" in
    *[!0-9]*|''|0*) echo "genai_perf.sh: '$n' is not a positive integer" >&2; exit 2 ;;
  esac
done
case "$WARMUP" in *[!0-9]*|'') echo "genai_perf.sh: WARMUP='$WARMUP'" >&2; exit 2 ;; esac
if [ "$WARMUP" -gt 0 ] && [ "$WARMUP" -lt "$CONCURRENCY" ]; then
  echo "genai_perf.sh: WARMUP=$WARMUP is below CONCURRENCY=$CONCURRENCY, with which" \
    "perf_analyzer 2.51 never finishes; using WARMUP=$CONCURRENCY" >&2
  WARMUP="$CONCURRENCY"
fi
DEFAULT_TOKENIZER=models/SmolLM2-135M-Instruct
TOKENIZER="${TOKENIZER:-$DEFAULT_TOKENIZER}"

. scripts/triton_env.sh  # tritonserver, perf_analyzer and the project's venv python on PATH
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python)"
if [ "$TOKENIZER" = "$DEFAULT_TOKENIZER" ]; then
  "$PY" scripts/build_default_model.py >/dev/null  # the embedded default model (idempotent)
fi
case "$TOKENIZER" in /*) ;; *) TOKENIZER="$ROOT/$TOKENIZER" ;; esac

VENV="$("$PY" scripts/client_venv.py genai-perf)"  # made (pip) on first use, reused after
GENAI_PERF="$VENV/bin/genai-perf"

WORK="$(mktemp -d /tmp/genai_perf.XXXXXX)"
. scripts/server_control.sh  # model_ready, start_server_and_wait, stop_server
cleanup() {
  stop_server
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -z "$GRPC_URL" ]; then
  read -r HTTP_PORT GRPC_PORT METRICS_PORT < <("$PY" -c \
    "from minisgl_backend.benchmark.tritonserver import free_ports; print(*free_ports(3))")
  export HTTP_PORT GRPC_PORT METRICS_PORT
  GRPC_URL="localhost:$GRPC_PORT"
  echo "== starting scripts/serve.sh (HTTP $HTTP_PORT, gRPC $GRPC_PORT, metrics $METRICS_PORT)"
  start_server_and_wait genai_perf.sh "$WORK/server.log"
elif ! model_ready; then
  echo "genai_perf.sh: no ready 'ensemble' at $GRPC_URL" >&2
  exit 1
fi

ARGS=(profile -m ensemble --endpoint-type kserve --backend tensorrtllm --streaming
  -u "$GRPC_URL" --tokenizer "$TOKENIZER"
  --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count "$WARMUP"
  --synthetic-input-tokens-mean "$INPUT_TOKENS" --synthetic-input-tokens-stddev 0
  --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0
  --num-dataset-entries "$REQUESTS" --random-seed 0
  --artifact-dir "${ARTIFACT_DIR:-$WORK/artifacts}")
[ "${DETERMINISTIC:-1}" = 1 ] && ARGS+=(--output-tokens-mean-deterministic)
ARGS+=("${EXTRA[@]}")

echo "== genai-perf ${ARGS[*]}"
# perf_analyzer has (rarely, on a loaded host) exited 0 with its profile export left empty, which
# genai-perf then fails to parse: that failure alone is profiled once more.
for attempt in 1 2; do
  status=0
  # Offline: the tokenizer is a local folder; COLUMNS: genai-perf's table is as wide as the
  # terminal.
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS="${COLUMNS:-160}" "$GENAI_PERF" "${ARGS[@]}" \
    2>&1 | tee "$WORK/genai-perf.log" || status=$?
  if [ "$status" = 0 ] || [ "$attempt" = 2 ] \
      || ! grep -q "zero-length, empty document" "$WORK/genai-perf.log"; then
    exit "$status"
  fi
  echo "== perf_analyzer left its profile export empty; profiling again"
done
