"""The effect of each engine mechanism on one shape: the same workload with it off and on.

- CUDA graphs: `cuda_graph_max_bs=0` vs the default (or `--cuda-graph-max-bs`), anchor workload;
- overlap scheduling: `overlap=False` vs True, anchor workload;
- radix prefix cache: `cache="naive"` vs "radix", shared-prefix workload (one random
  `--prefix-len`-token system prompt + a distinct `--suffix-len`-token suffix per request, short
  greedy outputs).

The "on" variant of all three is the same engine (every mechanism on), started once. Every
request is submitted at the same instant through the scheduler (`benchmark.timing`), so each run
gives output tok/s (requested output tokens / wall time) and the mean time to first token.
Each variant is its own `LLM`, warmed up first and shut down before the next one starts.

    python scripts/bench_mechanisms.py                      # Llama-3.1-8B shape on the GPU
    python scripts/bench_mechanisms.py --device cpu --shape tiny-llama --num-requests 4 \
        --min-len 4 --max-len 16 --prefix-requests 4 --prefix-len 64   # smoke test
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_backend.benchmark.cli import (
    add_llm_args,
    add_model_args,
    engine_dtype,
    llm_kwargs,
    markdown_table,
    model_folder,
    print_header,
)
from minisgl_backend.benchmark.timing import RunTiming, run_timed
from minisgl_backend.benchmark.workloads import (
    Workload,
    anchor_workload,
    fixed_workload,
    shared_prefix_workload,
)

HEADER = ("mechanism", "setting", "workload", "requests", "total s", "output tok/s",
          "mean TTFT ms", "prompt cache hits", "speed-up")
MECHANISMS = ("cuda-graphs", "overlap", "radix-cache")


@dataclass(frozen=True)
class Variant:
    name: str  # the engine variant, e.g. "all on" or "overlap off"
    settings: dict[str, Any]  # `LLM` keyword arguments over the base ones
    workloads: tuple[str, ...]  # "anchor", "prefix"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_llm_args(parser)
    parser.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=MECHANISMS)
    anchor = parser.add_argument_group("anchor workload (CUDA graphs, overlap)")
    anchor.add_argument("--num-requests", type=int, default=64)
    anchor.add_argument("--min-len", type=int, default=100)
    anchor.add_argument("--max-len", type=int, default=1024)
    prefix = parser.add_argument_group("shared-prefix workload (radix cache)")
    prefix.add_argument("--prefix-requests", type=int, default=64)
    prefix.add_argument("--prefix-len", type=int, default=2000)
    prefix.add_argument("--suffix-len", type=int, default=32)
    prefix.add_argument("--prefix-output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def variants(args: argparse.Namespace) -> list[Variant]:
    on_workloads = tuple(w for m, w in (("cuda-graphs", "anchor"), ("overlap", "anchor"),
                                        ("radix-cache", "prefix")) if m in args.mechanisms)
    all_on = {"overlap": True, "cache": "radix"}
    out = [Variant("all on", all_on, tuple(dict.fromkeys(on_workloads)))]
    if "cuda-graphs" in args.mechanisms:
        out.append(Variant("cuda graphs off", {**all_on, "cuda_graph_max_bs": 0}, ("anchor",)))
    if "overlap" in args.mechanisms:
        out.append(Variant("overlap off", {**all_on, "overlap": False}, ("anchor",)))
    if "radix-cache" in args.mechanisms:
        out.append(Variant("radix off", {**all_on, "cache": "naive"}, ("prefix",)))
    return out


def run_variant(args: argparse.Namespace, folder: Path, variant: Variant,
                workloads: dict[str, Workload], vocab: int) -> dict[str, RunTiming]:
    from minisgl_backend import LLM

    results = {}
    with LLM(folder, **llm_kwargs(args, **variant.settings)) as llm:
        warmup = fixed_workload(vocab, 8, 32, 8, seed=args.seed + 1)
        run_timed(llm, warmup)
        for name in variant.workloads:
            results[name] = run_timed(llm, workloads[name])
            print(f"{variant.name}, {name}: {results[name].wall_s:.3f} s", flush=True)
    return results


def table_rows(args: argparse.Namespace, runs: dict[str, dict[str, RunTiming]],
               workloads: dict[str, Workload]) -> list[list[str]]:
    groups = [("cuda-graphs", "CUDA graphs", "cuda graphs off", "anchor"),
              ("overlap", "overlap", "overlap off", "anchor"),
              ("radix-cache", "radix cache", "radix off", "prefix")]
    rows = []
    for key, label, off_variant, workload in groups:
        if key not in args.mechanisms:
            continue
        off, on = runs[off_variant][workload], runs["all on"][workload]
        prompt_tokens = workloads[workload].input_tokens
        for setting, run in (("off", off), ("on", on)):
            rows.append([label, setting, workload, str(len(run.requests)), f"{run.wall_s:.3f}",
                         f"{run.output_tokens_per_s:.1f}", f"{1e3 * run.mean_ttft_s:.1f}",
                         f"{run.cached_tokens / prompt_tokens:.1%}",
                         f"{run.output_tokens_per_s / off.output_tokens_per_s:.2f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with model_folder(args) as (folder, config):
        vocab = config["vocab_size"]
        workloads = {
            "anchor": anchor_workload(vocab, args.num_requests, args.min_len, args.max_len,
                                      args.seed),
            "prefix": shared_prefix_workload(vocab, args.prefix_requests, args.prefix_len,
                                             args.suffix_len, args.prefix_output_len, args.seed),
        }
        runs = {v.name: run_variant(args, folder, v, workloads, vocab) for v in variants(args)}
        print()
        print_header(args, config, engine_dtype(args, config))
        base = {k: v for k, v in llm_kwargs(args).items() if k not in ("device", "dtype")}
        print(f"base LLM settings {base}; anchor: {args.num_requests} requests, lengths in "
              f"[{args.min_len}, {args.max_len}], temperature 0.6; prefix: "
              f"{args.prefix_requests} requests of {args.prefix_len} shared + {args.suffix_len} "
              f"own tokens, {args.prefix_output_len} greedy output tokens; all requests "
              f"submitted at once; speed-up = output tok/s over the 'off' row")
        print()
        print(markdown_table(HEADER, table_rows(args, runs, workloads)))


if __name__ == "__main__":
    main()
