# Source me (bash) from the repository root: creates .venv if missing, installs what is missing
# (engine, tests, Triton server and client), builds the embedded default model. Idempotent.

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate

# torch is pinned to the CPU build that CI machines carry locally (an unpinned torch pulls a
# multi-GB CUDA build); where torch is already present (GPU hosts, containers) it is kept.
if ! python -c "import torch" 2>/dev/null; then
  pip install --quiet "torch==2.13.0"
fi
if ! python -c "import minisgl_backend, kernels, transformers, pytest, gguf, triton, xgrammar, jsonschema, fastapi, uvicorn, openai, aiohttp, zmq, msgpack, yaml" 2>/dev/null; then
  pip install --quiet -r requirements-test.txt
  pip install --quiet --no-deps -e .
fi
python scripts/build_default_model.py >/dev/null
. scripts/triton_env.sh  # tritonserver, perf_analyzer, run_tritonserver
