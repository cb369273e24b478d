#!/usr/bin/env bash
# Every GPU check and benchmark of issue 4 in one go on an H200 host, each step bounded in time
# so that a device lease is used to the end: kernels compiled first (scripts/warm_kernels.py, in
# the background on the last GPU while the Triton-only GPU tests run), then the FlashInfer and
# tensor-parallel GPU tests, then the benchmarks recorded in benchmark/RESULTS.md.
#
#   benchmark/run_h200.sh [OUT_DIR]     # logs in OUT_DIR (default: ./h200-logs)
#
# Environment: BUDGET_S (seconds for the whole run, default 3000: steps that would not fit are
# skipped and say so), STEPS (which steps, default all: tests offline decode decode1 controls new
# overheads fi spec kernels mechanisms profile triton mixed timelines hostprofile ab tp),
# WARM_KERNELS=0 to skip compiling FlashInfer, AB_ROUNDS the `ab` step's rounds (default 1),
# FI_TESTS the `fi` step's pytest -k (default flashinfer), SAVE_KERNELS=1 to write the compiled
# kernels to OUT_DIR/kernel-cache.tar.xz, SHAPES the `overheads` step's model shapes (default
# qwen3-0.6b llama-3.1-8b), CONCURRENCY the `triton` step's (default 64 256), HP_CONFIGS,
# HP_MODE and HP_BACKEND the `hostprofile` step's configurations (default unguided json_schema
# none logprobs all), what it records besides the timeline (profile, trace or timeline) and
# attention backend (default triton), CMD the `cmd` step's command line (any script, with this
# setup; CMD_LIMIT_S, default 300).
# flashinfer must be importable; the `triton` step (and `mixed`'s server run) needs tritonserver
# and perf_analyzer on PATH (TRITON_BACKEND_DIR for a wheel install); `tp` needs two GPUs.
#
# On a host without a package registry, what is missing travels in .carry/ (git-ignored):
# site.tar.xz, wheels unpacked (flashinfer, xgrammar, nvidia-pytriton, tritonclient, ...), goes
# on PYTHONPATH, and the server is prepared from it (scripts/install_triton.py --no-install);
# kernel-cache.tar.xz, a SAVE_KERNELS=1 run's compiled kernels, saves compiling them again.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-h200-logs}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BUDGET_S=${BUDGET_S:-3000}
STEPS=${STEPS:-tests offline decode decode1 controls new overheads fi spec kernels mechanisms profile triton mixed timelines hostprofile ab tp}
if [ -f .carry/site.tar.xz ]; then  # unpacked once per machine (a warm one keeps /tmp)
  [ -f /tmp/site/.unpacked ] || { mkdir -p /tmp/site \
    && tar -I "xz -T0" -xf .carry/site.tar.xz -C /tmp/site && touch /tmp/site/.unpacked; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -f .carry/kernel-cache.tar.xz ] && tar -I "xz -T0" -xf .carry/kernel-cache.tar.xz -C "$HOME"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# (find_spec, not an import: the pytriton package's own Python needs packages that do not travel)
if ! command -v tritonserver > /dev/null && python3 -c \
    "import importlib.util, sys; sys.exit(importlib.util.find_spec('pytriton') is None)"; then
  python3 scripts/install_triton.py --no-install --prefix /tmp/triton > "$OUT/install_triton.log" \
    2>&1 && . /tmp/triton/env.sh
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
T0=$SECONDS

# step SECONDS NAME COMMAND...: run COMMAND (output to OUT/NAME.log, its tail echoed) if it
# fits in what is left of the budget, stopped after SECONDS.
step() {
  local limit=$1 name=$2; shift 2
  if [ $((SECONDS - T0 + limit)) -gt "$BUDGET_S" ]; then echo "== $name: skipped (budget)"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? at $((SECONDS - T0)) s"; tail -n "${TAIL:-12}" "$OUT/$name.log"
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }

echo "== $GPUS GPU(s); steps: $STEPS; budget $BUDGET_S s"
WARM=
if [ "${WARM_KERNELS:-1}" = 1 ]; then  # WARM_KERNELS=0: steps that need no FlashInfer only
  CUDA_VISIBLE_DEVICES=$((GPUS - 1)) timeout 900 python3 scripts/warm_kernels.py \
    > "$OUT/warm.log" 2>&1 &
  WARM=$!
fi
if wants tests; then
  CUDA_VISIBLE_DEVICES=0 step 600 tests-triton python3 -m pytest -q -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_qkv_prologue.py tests/test_fused_moe.py \
    tests/test_activation.py tests/test_sampling_kernel.py tests/test_gemv.py \
    tests/test_gpu_engine.py \
    -k "not flashinfer and not tensor_parallel"
fi
if [ -n "$WARM" ]; then
  wait $WARM; echo "== kernels warm (exit $?) at $((SECONDS - T0)) s"; tail -n 3 "$OUT/warm.log"
fi
wants tests && step 600 tests-flashinfer-tp python3 -m pytest -q -p no:cacheprovider \
  tests/test_gpu_engine.py tests/test_triton_attention.py -k "flashinfer or tensor_parallel"
export CUDA_VISIBLE_DEVICES=0
# The anchor workload without, then with the shape's tokenizer (two engines, each timed call
# 7-15 s): the detokenizer's cost. + each engine's device timeline in OUT/steps.
for shape in qwen3-0.6b llama-3.1-8b; do
  wants offline && MINISGL_STEP_TIMES_DIR="$OUT/steps" TAIL=7 step 300 "offline-$shape" \
    python3 scripts/bench_offline.py --shape "$shape" --page-size 64 --detokenize both
done
if wants decode; then
  step 600 decode-llama-3.1-8b python3 scripts/bench_decode.py --shape llama-3.1-8b \
    --new-tokens 256 --repeats 1
  TAIL=3 step 120 decode-qwen3-0.6b-graphs python3 scripts/bench_decode.py --shape qwen3-0.6b \
    --batch-sizes 1 --new-tokens 256 --skip-hf
  # The fused few-rows GEMVs (default up to batch 2 for small layers) against cuBLAS.
  TAIL=6 step 120 decode-qwen3-0.6b-fused-4 python3 scripts/bench_decode.py --shape qwen3-0.6b \
    --batch-sizes 1 2 4 8 --new-tokens 128 --skip-hf --fused-gemv-max-bs 4
  TAIL=6 step 120 decode-qwen3-0.6b-fused-off python3 scripts/bench_decode.py \
    --shape qwen3-0.6b --batch-sizes 1 2 4 8 --new-tokens 128 --skip-hf --fused-gemv-max-bs 0
  TAIL=3 step 120 decode-qwen3-0.6b-eager python3 scripts/bench_decode.py --shape qwen3-0.6b \
    --batch-sizes 1 --new-tokens 256 --skip-hf --cuda-graph-max-bs 0
fi
if wants decode1; then  # issue 4's batch-1 targets alone: 8B vs its roofline, 0.6B, graphs vs eager
  TAIL=4 step 180 decode1-llama-3.1-8b python3 scripts/bench_decode.py --shape llama-3.1-8b \
    --batch-sizes 1 --new-tokens 256 --skip-hf
  TAIL=3 step 120 decode1-qwen3-0.6b-graphs python3 scripts/bench_decode.py \
    --shape qwen3-0.6b --batch-sizes 1 --new-tokens 256 --skip-hf
  TAIL=3 step 120 decode1-qwen3-0.6b-eager python3 scripts/bench_decode.py --shape qwen3-0.6b \
    --batch-sizes 1 --new-tokens 256 --skip-hf --cuda-graph-max-bs 0
fi
if wants controls; then  # per-request sampling controls on the GPU: their kernels, float32 vs HF
  step 600 tests-controls python3 -m pytest -q -p no:cacheprovider tests/test_logit_edits.py \
    tests/test_penalties.py tests/test_gpu_sampling_controls.py
fi
if wants new; then  # issues 17-18 on the GPU: verify steps, windows, architectures (guided: controls)
  step 420 tests-new python3 -m pytest -q -p no:cacheprovider tests/test_gpu_speculative.py \
    tests/test_sliding_window_gpu.py tests/test_gpu_architectures.py \
    -k "not flashinfer"  # their FlashInfer cases: step fi
  step 300 tests-engine python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py \
    tests/test_triton_attention.py -k "window or (not flashinfer and not tensor_parallel)"
fi
if wants overheads; then  # every sampling control, and a JSON-schema mix, against none
  # A guided step's host work alone (mask fills by thread count, up to xgrammar's default).
  TAIL=8 step 120 grammar-masks python3 scripts/bench_grammar_masks.py --device cuda \
    --vocab-size 151936 --rows 1 64 256 --threads 1 2 4 8 \
    "$(python3 -c 'import os; print(max(1, os.cpu_count() // 2))')"
  for shape in ${SHAPES:-qwen3-0.6b llama-3.1-8b}; do
    TAIL=8 step 240 "overhead-controls-$shape" python3 scripts/bench_sampling_controls.py \
      --device cuda --shape "$shape" --batch-sizes 1 64 256
    # Llama 3's tokens and vocabulary size (no Qwen tokenizer travels; padded to Qwen3's
    # 151,936 ids xgrammar's accepts would slow down); two engines.
    TAIL=12 step 300 "overhead-json-$shape" python3 scripts/bench_structured_output.py \
      --device cuda --shape "$shape" --tokenizer llama-3 --vocab-size 128256 \
      --batch-sizes 1 64 256 --max-total-tokens 65536 --repeats 2
  done
fi
if wants fi; then  # the FlashInfer cases of issues 17-18's GPU tests (verify steps, windows)
  step 300 tests-flashinfer-new python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu_speculative.py tests/test_sliding_window_gpu.py -k "${FI_TESTS:-flashinfer}"
fi
if wants spec; then  # speculative decoding against the bandwidth roofline, synthetic acceptance
  TAIL=12 step 420 spec-llama-3.1-8b python3 scripts/bench_speculative.py \
    --shape llama-3.1-8b --batch-sizes 1 8 --acceptance 0.6 0.8 --num-speculative-tokens 4 \
    --new-tokens 128 --attention-backend "${SPEC_BACKEND:-triton}"
fi
wants kernels && TAIL=40 step 300 kernels python3 scripts/bench_kernels.py \
  --batch-sizes 1 8 64 256 --context-lens 256 1024 2048 --page-sizes 16 64 \
  --parts attention silu sampling prologue
# The fused few-rows GEMV's tiles against the layer's ops today (decides its wiring).
wants kernels && TAIL=60 step 300 kernels-gemv python3 scripts/bench_kernels.py --parts gemv \
  --sweep --shapes llama-3.1-8b qwen3-0.6b --batch-sizes 1 2 4
if wants mixed; then  # mixed prefill steps against the default, offline and at concurrency 64
  for shape in qwen3-0.6b llama-3.1-8b; do
    MINISGL_STEP_TIMES_DIR="$OUT/steps" TAIL=1 step 180 "offline-$shape-mixed" \
      python3 scripts/bench_offline.py --shape "$shape" --page-size 64 --mixed-prefill
  done
  if command -v tritonserver > /dev/null && command -v perf_analyzer > /dev/null; then
    TAIL=8 step 300 triton-qwen3-0.6b-mixed python3 scripts/bench_triton_offline.py \
      --shape qwen3-0.6b --page-size 64 --concurrency 64 --mixed-prefill
  fi
fi
wants mechanisms && TAIL=9 step 300 mechanisms-qwen3-0.6b python3 scripts/bench_mechanisms.py \
  --shape qwen3-0.6b --page-size 16
# Batch 1 on both shapes: the small one's host launch time, the 8B step's kernels and gaps.
wants profile && TAIL=16 step 150 profile-qwen3-0.6b python3 scripts/profile_decode_step.py \
  --shape qwen3-0.6b --batch-sizes 1 --steps 150 --backends triton
wants profile && TAIL=40 step 180 profile-llama-3.1-8b python3 scripts/profile_decode_step.py \
  --shape llama-3.1-8b --batch-sizes 1 --steps 60 --backends triton --trace
if wants triton && command -v tritonserver > /dev/null && command -v perf_analyzer > /dev/null; then
  TAIL=8 step 600 triton-qwen3-0.6b python3 scripts/bench_triton_offline.py --shape qwen3-0.6b \
    --page-size 64 --concurrency ${CONCURRENCY:-64 256}
fi
# The batch-64 host-work benchmarks on the Qwen3-0.6B shape (the steps below add their batch
# sizes, repeats and configurations): the JSON-schema mix, with Llama 3's tokens and vocabulary
# as in `overheads`, and the sampling controls, on random weights.
JSON_MIX=(scripts/bench_structured_output.py --device cuda --shape qwen3-0.6b --tokenizer
          llama-3 --vocab-size 128256 --max-total-tokens 65536)
CONTROLS_MIX=(scripts/bench_sampling_controls.py --device cuda --shape qwen3-0.6b --load-format
              dummy)
# One configuration per run at batch 64, each with its own step timeline (and the JSON run once
# more with the scheduler's cProfile): where a guided step and the controls' steps spend time.
if wants timelines; then
  for config in unguided json_schema; do
    MINISGL_STEP_TIMES_DIR=$OUT/timelines/$config TAIL=4 step 120 "timeline-$config" python3 \
      "${JSON_MIX[@]}" --batch-sizes 64 --repeats 2 --configs $config
  done
  MINISGL_PROFILE_DIR=$OUT/timelines/json_schema-profile TAIL=4 step 120 timeline-json-profile \
    python3 "${JSON_MIX[@]}" --batch-sizes 64 --repeats 1 --configs json_schema
  for config in none logprobs all; do
    MINISGL_STEP_TIMES_DIR=$OUT/timelines/controls-$config TAIL=4 step 120 "timeline-$config" \
      python3 "${CONTROLS_MIX[@]}" --batch-sizes 64 --repeats 2 --configs $config
  done
  for f in "$OUT"/timelines/*/engine-rank0-*-steps.txt; do
    echo "-- $f"; grep -E "^\| (decode|64) \|" "$f"
  done
fi
# The host's work per step at batch 64, one configuration per run (Qwen3-0.6B shape), each
# with its step timeline and, by HP_MODE, the cProfile of its engine rank 0 and scheduler
# summarised per call, libraries' functions too (profile, the default), a torch.profiler trace
# of 20 decode steps (trace) or nothing more (timeline): what a guided or controlled step adds
# to each process's turn.
if wants hostprofile; then
  mode=${HP_MODE:-profile}; hp=$OUT/hostprofile-$mode
  for config in ${HP_CONFIGS:-unguided json_schema none logprobs all}; do
    if [[ $config == unguided || $config == json_schema ]]; then
      bench=("${JSON_MIX[@]}")
    else
      bench=("${CONTROLS_MIX[@]}")
    fi
    extra=(); [ "$mode" = profile ] && extra=(MINISGL_PROFILE_DIR=$hp/$config)
    [ "$mode" = trace ] && extra=(MINISGL_TRACE_DIR=$hp/$config MINISGL_TRACE_STEPS=60:20)
    TAIL=3 step 120 "hostprofile-$mode-$config" env MINISGL_STEP_TIMES_DIR=$hp/$config \
      "${extra[@]}" python3 "${bench[@]}" --batch-sizes 64 --repeats 2 --configs "$config" \
      --attention-backend "${HP_BACKEND:-triton}"
    for f in "$hp/$config"/engine-rank0-*-steps.txt; do grep -E "^\| (decode|64) \|" "$f"; done
    [ "$mode" = profile ] && python3 scripts/profile_summary.py --all --top "${HP_TOP:-25}" \
      --min-calls 200 "$hp/$config"/engine-rank0-*.prof "$hp/$config"/scheduler-*.prof \
      > "$OUT/hostprofile-$config.txt" 2>&1
  done
fi
# This tree against another commit's engine in .carry/base (benchmark/pack_base.sh COMMIT), in
# the order base, new, new, base (AB_ROUNDS such rounds, default 1) so that drift in the host's
# speed falls on both: issue 4's offline targets, the JSON mix and every control at batch 64
# (AB_BENCHES picks some, for a device call's limit: an 8B round takes about 6 minutes).
if wants ab && [ -d .carry/base/minisgl_backend ]; then
  for bench in ${AB_BENCHES:-offline-qwen3-0.6b offline-llama-3.1-8b json controls}; do
    case $bench in
      offline-*) args=(scripts/bench_offline.py --shape "${bench#offline-}" --page-size 64
                       --detokenize on --attention-backend triton); limit=150 ;;
      json) args=("${JSON_MIX[@]}" --attention-backend triton --batch-sizes 64 --max-tokens 256
                  --repeats 2 --configs unguided json_schema); limit=120 ;;
      controls) args=("${CONTROLS_MIX[@]}" --attention-backend triton --batch-sizes 64
                      --repeats 2 --configs none all); limit=120 ;;
      *) echo "== ab: no bench $bench"; continue ;;
    esac
    for ((round = 1; round <= ${AB_ROUNDS:-1}; round++)); do
      i=0
      for who in base new new base; do
        pp=$PYTHONPATH; [ $who = base ] && pp=$PWD/.carry/base:$PYTHONPATH
        TAIL=0 step $limit "ab-$bench-$round$((++i))-$who" env PYTHONPATH="$pp" \
          python3 "${args[@]}"
      done
    done
  done
  echo "== ab: the table rows of each run (base = .carry/base, new = this tree)"
  for f in "$OUT"/ab-*.log; do
    printf '%s\n' "-- $(basename "$f" .log)"; grep -E "^(\| [0-9a-z]|garbage|detokenizer cost)" "$f"
  done
elif wants ab; then
  echo "== ab: skipped (no .carry/base: benchmark/pack_base.sh COMMIT makes it)"
fi
wants cmd && step "${CMD_LIMIT_S:-300}" cmd bash -c "$CMD"  # an ad-hoc command, same setup
unset CUDA_VISIBLE_DEVICES
if wants tp && [ "$GPUS" -ge 2 ]; then
  TAIL=1 step 240 offline-llama-3.1-8b-tp2 python3 scripts/bench_offline.py \
    --shape llama-3.1-8b --page-size 64 --tp-size 2
  TAIL=3 step 180 decode-llama-3.1-8b-tp2 python3 scripts/bench_decode.py --shape llama-3.1-8b \
    --batch-sizes 1 --new-tokens 256 --skip-hf --tp-size 2
fi
if [ "${SAVE_KERNELS:-0}" = 1 ]; then
  (cd "$HOME" && tar -I "xz -T0 -3" -cf "$OUT/kernel-cache.tar.xz" \
    $(ls -d .cache/flashinfer .triton/cache 2> /dev/null)) && ls -l "$OUT/kernel-cache.tar.xz"
fi
echo "== done at $((SECONDS - T0)) s; logs in $OUT"
