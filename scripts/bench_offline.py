"""Offline throughput on the anchor workload: one `LLM.generate` call, prefill included.

The anchor workload (`minisgl_backend.benchmark.workloads.anchor_workload`): `--num-requests`
requests (256) with input and output lengths uniform in [100, 1024] (`random.Random(seed)`),
random prompt tokens, temperature 0.6, ignore_eos, max_tokens = the output length. After a
short warm-up, all of them go through one `generate` call, and

    output tok/s = requested output tokens / wall time of that call.

    python scripts/bench_offline.py                            # Llama-3.1-8B shape on the GPU
    python scripts/bench_offline.py --shape qwen3-30b-a3b --tp-size 2
    python scripts/bench_offline.py --device cpu --shape tiny-qwen3 --num-requests 4 \
        --min-len 4 --max-len 16                              # smoke test
"""

from __future__ import annotations

import argparse
import time

from minisgl_backend.benchmark.cli import (
    add_llm_args,
    add_model_args,
    engine_dtype,
    llm_kwargs,
    markdown_table,
    model_folder,
    print_header,
)
from minisgl_backend.benchmark.workloads import anchor_workload, fixed_workload

HEADER = ("shape", "requests", "input tokens", "output tokens", "total s", "output tok/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_llm_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="input and output lengths")
    parser.add_argument("--max-len", type=int, default=1024, help="input and output lengths")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from minisgl_backend import LLM

    args = parse_args(argv)
    with model_folder(args) as (folder, config):
        workload = anchor_workload(config["vocab_size"], args.num_requests, args.min_len,
                                   args.max_len, args.seed, args.temperature)
        kwargs = llm_kwargs(args)
        with LLM(folder, **kwargs) as llm:
            warmup = fixed_workload(config["vocab_size"], 8, 32, 8, seed=args.seed + 1)
            llm.generate(warmup.prompts, warmup.params)
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, workload.params)
            seconds = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outputs)
        if generated != workload.output_tokens:
            raise RuntimeError(f"generated {generated} tokens, requested {workload.output_tokens}")
        print()
        print_header(args, config, engine_dtype(args, config))
        print(f"anchor workload: {len(workload)} requests, lengths uniform in [{args.min_len}, "
              f"{args.max_len}], seed {args.seed}, temperature {args.temperature}; "
              f"LLM settings { {k: v for k, v in kwargs.items() if k not in ('device', 'dtype')} }")
        print()
        row = [args.shape, str(len(workload)), str(workload.input_tokens),
               str(workload.output_tokens), f"{seconds:.3f}",
               f"{workload.output_tokens / seconds:.1f}"]
        print(markdown_table(HEADER, [row]))


if __name__ == "__main__":
    main()
