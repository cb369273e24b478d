# Source me (bash): . scripts/triton_env.sh
# Puts tritonserver and perf_analyzer on PATH (installing them on first use with
# scripts/install_triton.py, run by the active venv's python, else .venv/bin/python, else
# python3) and defines run_tritonserver, which execs tritonserver with
# --backend-directory="$TRITON_BACKEND_DIR" when that is set (wheel install) and without it
# otherwise (NGC container: the server's default backend directory), passing other args on.

_triton_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The installer installs into the interpreter that runs it: the active venv, else the repo's .venv.
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  _triton_py="$VIRTUAL_ENV/bin/python"
elif [ -x "$_triton_root/.venv/bin/python" ]; then
  _triton_py="$_triton_root/.venv/bin/python"
else
  _triton_py="$(command -v python3 || command -v python)"
fi

# Runs the installer when .triton/env.sh is missing; when it exists, too, because the
# installer's own check (marker file, ~0.1 s) also catches a stale one (venv recreated,
# packages removed, another venv active) and then repairs it.
if ! "$_triton_py" "$_triton_root/scripts/install_triton.py" >/dev/null; then
  echo "triton_env.sh: scripts/install_triton.py failed" >&2
  unset _triton_root _triton_py
  return 1
fi
. "$_triton_root/.triton/env.sh"
unset _triton_root _triton_py

run_tritonserver() {
  if [ -n "${TRITON_BACKEND_DIR:-}" ]; then
    exec tritonserver --backend-directory="$TRITON_BACKEND_DIR" "$@"
  else
    exec tritonserver "$@"
  fi
}
