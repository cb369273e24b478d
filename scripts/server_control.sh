# Source me (bash) from a script that talks to a tritonserver serving `ensemble`: readiness,
# starting scripts/serve.sh and waiting for it, stopping it. The caller sets GRPC_URL (and
# PY, the python with tritonclient; default: python on PATH); SERVER_PID is the server this
# script started ("" when none).

SERVER_PID=""

model_ready() {  # exit 0 when the ensemble is ready at GRPC_URL
  "${PY:-python}" - "$GRPC_URL" <<'PYEOF' 2>/dev/null
import sys
import tritonclient.grpc as grpcclient
try:
    ok = grpcclient.InferenceServerClient(sys.argv[1]).is_model_ready("ensemble")
except Exception:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

start_server_and_wait() {  # start_server_and_wait NAME LOG: serve.sh in the background
  local name="$1" log="$2" deadline
  # Without the OpenAI API (these scripts speak Triton's), serve.sh execs tritonserver: same pid
  OPENAI_PORT=0 ./scripts/serve.sh > "$log" 2>&1 &
  SERVER_PID=$!
  deadline=$((SECONDS + ${READY_TIMEOUT:-600}))
  until model_ready; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
      echo "$name: the server did not become ready; last log lines:" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
    sleep 2
  done
}

stop_server() {  # SIGTERM the server this script started; SIGKILL after 60 s
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "== stopping the server (pid $SERVER_PID)"
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 120); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
}
