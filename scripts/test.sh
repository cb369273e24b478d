#!/usr/bin/env bash
# Install what is missing into .venv, build the embedded default model, run the whole test suite
# (the Triton tests start a real tritonserver). Idempotent; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
exec python -m pytest "$@"
