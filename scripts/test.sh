#!/usr/bin/env bash
# Install what is missing into .venv, build the embedded default model, run the whole test suite.
# Idempotent: a second run installs nothing and reuses the model folder.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate

# torch is pinned to the CPU build that CI machines carry locally (an unpinned torch pulls a
# multi-GB CUDA build); on a GPU machine with torch already present this step is skipped.
if ! python -c "import torch" 2>/dev/null; then
  pip install --quiet "torch==2.13.0"
fi
pip install --quiet -r requirements-test.txt
pip install --quiet --no-deps -e .

python scripts/build_default_model.py
exec python -m pytest "$@"
