"""Compile the GPU kernels ahead: FlashInfer JIT-compiles each kernel family on first use
(minutes on a fresh machine: prefill, decode with and without tensor cores, norms, RoPE,
SiLU-and-mul) and Triton compiles the project's kernels; both cache on disk. Run once before
timing anything, e.g. in the background while other work uses the GPU.

Each variant runs a tiny 2-layer model of a real shape (random weights) through prefill,
chunked prefill with a cached prefix, eager decode and CUDA-graph decode, with temperature
sampling.

    python scripts/warm_kernels.py                      # bf16, head dim 128, pages 1 and 16
    python scripts/warm_kernels.py --device cpu --shapes tiny-qwen3 --backends torch  # smoke
"""

from __future__ import annotations

import argparse
import tempfile
import time

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.benchmark.shapes import shape_config, write_config

# Qwen3-0.6B: 2 query heads per KV head (CUDA-core decode); Llama-3.1-8B: 4 (tensor cores).
DEFAULT_SHAPES = ("qwen3-0.6b", "llama-3.1-8b")


def warm(shape: str, backend: str, page_size: int, device: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        write_config(shape_config(shape, 2), folder)
        with LLM(folder, load_format="dummy", device=device, attention_backend=backend,
                 page_size=page_size, max_total_tokens=4096,
                 cuda_graph_max_bs=4, max_running_requests=8, chunked_prefill_size=64) as llm:
            prompts = [[5 + i] * (40 + 30 * i) for i in range(4)]
            sampled = SamplingParams(max_tokens=6, temperature=0.6, ignore_eos=True)
            llm.generate(prompts, sampled)
            llm.generate([p + [9] * 20 for p in prompts], SamplingParams(max_tokens=3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--backends", nargs="+", default=["flashinfer", "auto"])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--device", default="auto", help="cpu: a smoke test (torch backend)")
    args = parser.parse_args()
    start = time.perf_counter()
    for shape in args.shapes:
        for backend in args.backends:
            for page_size in args.page_sizes:
                warm(shape, backend, page_size, args.device)
                print(f"{shape}, {backend}, page {page_size}: warm after "
                      f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
