#!/usr/bin/env bash
# Put another commit's engine into .carry/base, for side-by-side runs on the H200 host: a device
# call carries .carry, and a command there runs the base with PYTHONPATH=$PWD/.carry/base first
# (the scripts stay the working tree's). The scripts' harness, `minisgl_backend.benchmark`
# (workloads, timing, the collector's line), is the working tree's too, so that both trees run
# the same measurement. The benchmark's tokenizers come along, because
# `minisgl_backend.benchmark.tokenizer` looks for them next to the package.
#
#   benchmark/pack_base.sh HEAD                   # before changing the engine
#   PYTHONPATH=$PWD/.carry/base:$PYTHONPATH python3 scripts/bench_sampling_controls.py ...
set -eu
cd "$(dirname "$0")/.."
commit=${1:?usage: benchmark/pack_base.sh COMMIT}
rm -rf .carry/base && mkdir -p .carry/base
git archive "$commit" kernels minisgl_backend benchmark/tokenizers | tar -x -C .carry/base
rm -rf .carry/base/minisgl_backend/benchmark
git ls-files -z minisgl_backend/benchmark | xargs -0 cp --parents -t .carry/base
du -sh .carry/base
