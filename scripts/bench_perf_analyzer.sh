#!/usr/bin/env bash
# Benchmark the Triton `ensemble` model in streaming mode (decoupled, one response per token)
# over gRPC with perf_analyzer, one run per concurrency, then print a summary table.
#
#   scripts/bench_perf_analyzer.sh [--start] [CONCURRENCY ...]
#
# Without --start it uses a running server at GRPC_URL (default localhost:8001). With --start it
# starts scripts/serve.sh in the background on HTTP_PORT/GRPC_PORT/METRICS_PORT (8000/8001/8002),
# waits until the ensemble is ready, benchmarks it and stops it (SIGTERM) at the end.
#
# Environment (defaults):
#   CONCURRENCY="1 4 16"     concurrencies (positional arguments override it)
#   MAX_TOKENS=64            output tokens per request (ignore_eos: always exactly this many)
#   REQUESTS_PER_SLOT=1      requests measured per concurrency = concurrency x this
#   WARMUP=1                 one short request first (0: none)
#   READY_TIMEOUT=600        seconds to wait for a server started with --start
#   KEEP_DIR=                a folder to keep the input data, CSV and profile exports in
set -euo pipefail
cd "$(dirname "$0")/.."

START=0
CONC=()
for arg in "$@"; do
  case "$arg" in
    --start) START=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *[!0-9]*|'') echo "bench_perf_analyzer.sh: bad argument '$arg' (see --help)" >&2; exit 2 ;;
    *) CONC+=("$arg") ;;
  esac
done
[ ${#CONC[@]} -gt 0 ] || read -r -a CONC <<< "${CONCURRENCY:-1 4 16}"
MAX_TOKENS="${MAX_TOKENS:-64}"
REQUESTS_PER_SLOT="${REQUESTS_PER_SLOT:-1}"
for n in "${CONC[@]}" "$MAX_TOKENS" "$REQUESTS_PER_SLOT"; do
  case "$n" in
    *[!0-9]*|''|0*) echo "bench_perf_analyzer.sh: '$n' is not a positive integer" >&2; exit 2 ;;
  esac
done
if [ "$START" = 1 ]; then
  GRPC_URL="${GRPC_URL:-localhost:${GRPC_PORT:-8001}}"
else
  GRPC_URL="${GRPC_URL:-localhost:8001}"
fi

. scripts/triton_env.sh  # perf_analyzer (and the venv's python, with tritonclient) on PATH

WORK="${KEEP_DIR:-$(mktemp -d /tmp/bench_pa.XXXXXX)}"
mkdir -p "$WORK"
. scripts/server_control.sh  # model_ready, start_server_and_wait, stop_server
cleanup() {
  stop_server
  [ -n "${KEEP_DIR:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$START" = 1 ]; then
  if model_ready; then
    echo "bench_perf_analyzer.sh: a server already answers at $GRPC_URL;" \
      "drop --start or change GRPC_PORT" >&2
    exit 1
  fi
  echo "== starting scripts/serve.sh (HTTP ${HTTP_PORT:-8000}, gRPC ${GRPC_PORT:-8001}," \
    "metrics ${METRICS_PORT:-8002}); log: $WORK/server.log"
  start_server_and_wait bench_perf_analyzer.sh "$WORK/server.log"
elif ! model_ready; then
  echo "bench_perf_analyzer.sh: no ready 'ensemble' at $GRPC_URL (set GRPC_URL, or use --start)" >&2
  exit 1
fi

# Input data: chat requests (a JSON list of messages + apply_chat_template) with the same system
# prompt and different questions. `stream` must be sent as an input tensor: the decoupled model
# then sends one response per token (without it: one response at the end).
python - "$WORK" "$MAX_TOKENS" <<'EOF'
import json, sys
work, max_tokens = sys.argv[1], int(sys.argv[2])
system = ("You are a friendly travel assistant. Answer with practical, concrete advice, "
          "short paragraphs, and no more detail than the question needs.")
questions = [
    "I am planning a three-day trip to Lisbon in April. Which neighbourhoods should I stay in, "
    "and what are a few things I should not miss?",
    "What is the best way to get from the airport to the city centre in Rome, and how much "
    "should I expect to pay?",
    "I have one free day in Kyoto. Can you suggest a walking route that avoids the biggest "
    "crowds?",
    "Which local dishes should I try in Mexico City, and are street food stalls safe for "
    "visitors?",
]
def entry(question: str, tokens: int) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"text_input": [json.dumps(messages)], "max_tokens": [tokens], "stream": [True],
            "apply_chat_template": [True], "ignore_eos": [True],
            "exclude_input_in_output": [True]}
json.dump({"data": [entry(q, max_tokens) for q in questions]}, open(f"{work}/input.json", "w"))
json.dump({"data": [entry(questions[0], 4)]}, open(f"{work}/warmup.json", "w"))
EOF

PA=(perf_analyzer -m ensemble -u "$GRPC_URL" -i grpc --streaming)
echo "== server $GRPC_URL; concurrencies: ${CONC[*]}; max_tokens $MAX_TOKENS;" \
  "$REQUESTS_PER_SLOT request(s) per concurrency slot"
if [ "${WARMUP:-1}" != 0 ]; then
  echo "== warmup (1 request, 4 tokens)"
  "${PA[@]}" --input-data "$WORK/warmup.json" --concurrency-range 1:1 --request-count 1 \
    > "$WORK/warmup.log" 2>&1 || { cat "$WORK/warmup.log" >&2; exit 1; }
fi
for c in "${CONC[@]}"; do
  n=$((c * REQUESTS_PER_SLOT))
  echo "== concurrency $c: $n requests"
  start=$SECONDS
  # --request-count: one measurement of exactly n requests (no stability search, which on a
  # CPU takes many long windows); latency = request sent -> final response.
  if ! "${PA[@]}" --input-data "$WORK/input.json" --concurrency-range "$c:$c" \
      --request-count "$n" -f "$WORK/c$c.csv" --profile-export-file "$WORK/c$c.json" \
      > "$WORK/c$c.log" 2>&1; then
    cat "$WORK/c$c.log" >&2
    echo "bench_perf_analyzer.sh: perf_analyzer failed at concurrency $c" >&2
    exit 1
  fi
  sed -n '/^Request concurrency/,/^  Server:/p' "$WORK/c$c.log" | sed '$d' \
    | sed -e '/^WARNING: Pass contained only one request/d' \
          -e 's/ (standard deviation 18446744073709551615 usec)//'  # 1 request: no deviation
  echo "    (took $((SECONDS - start)) s)"
done

python - "$WORK" "${CONC[@]}" <<'EOF'
import csv, json, sys
work, concurrencies = sys.argv[1], sys.argv[2:]
print("\nSummary: throughput from perf_analyzer; latency = request sent -> final response,")
print("TTFT -> first token, ITL = mean gap between tokens (from the profile export).")
print("| concurrency | requests | infer/s | response/s (≈ output tokens/s) | avg latency ms "
      "| p99 ms | avg TTFT ms | avg ITL ms |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
mean = lambda xs: sum(xs) / max(len(xs), 1)
for c in concurrencies:
    with open(f"{work}/c{c}.csv") as f:
        row = next(csv.DictReader(f))
    with open(f"{work}/c{c}.json") as f:
        requests = json.load(f)["experiments"][0]["requests"]
    stamps = [(r["timestamp"], r["response_timestamps"]) for r in requests
              if r["response_timestamps"]]
    latency = [(ts[-1] - t0) / 1e6 for t0, ts in stamps]
    ttft = [(ts[0] - t0) / 1e6 for t0, ts in stamps]
    itl = [(ts[-1] - ts[0]) / 1e6 / (len(ts) - 1) for _, ts in stamps if len(ts) > 1]
    print(f"| {c} | {len(requests)} | {float(row['Inferences/Second']):.3f} "
          f"| {float(row['Response Throughput']):.2f} | {mean(latency):.0f} "
          f"| {float(row['p99 latency']) / 1e3:.0f} | {mean(ttft):.0f} | {mean(itl):.0f} |")
EOF
