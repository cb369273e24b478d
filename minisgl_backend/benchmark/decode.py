"""Decode throughput per batch size, next to the batch-1 weight-read roofline.

Per batch size B, calls of B prompts of `--prompt-len` random tokens (fresh ones each call: no
prefix-cache hits) generate exactly T = `--new-tokens` tokens and exactly 1; the difference
covers T - 1 decode steps, so

    decode tok/s = B * (T - 1) / (best t_T - best t_1),   ms/step = the difference / (T - 1).

The roofline (batch 1) is the device's measured copy bandwidth over the weight bytes one step
must read (`hardware`). `--vary` adds engines with settings changed, e.g. CUDA graphs off
(`--vary cuda_graph_max_bs=0`) or the fused few-rows GEMVs off (`fused_gemv_max_bs=0`).
"""

from __future__ import annotations

import argparse
import itertools

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.hardware import measure_roofline
from minisgl_backend.benchmark.workloads import fixed_workload
from minisgl_backend.models import ModelConfig

HEADER = ("run", "batch", "new tokens", "decode tok/s", "ms/step", "roofline tok/s",
          "of roofline", "vs first")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    cli.add_vary_arg(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=256, help="T, for every batch size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings")
    parser.add_argument("--copy-mib", type=int,
                        help="bandwidth probe size (default 1024 MiB on GPU, 64 on CPU)")


def run(args: argparse.Namespace) -> None:
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (one decode step at least)")
    counter = itertools.count()
    rates = {}
    with cli.model_folder(args, tokenizer=False) as (folder, config):
        roof = measure_roofline(ModelConfig.from_dict(config), cli.engine_dtype(args, config),
                                cli.torch_device(args), args.tp_size or 1, args.copy_mib)
        for label, overrides in cli.variants(args):
            running = max(args.max_running_requests or 0, *args.batch_sizes)
            with cli.make_llm(args, folder, **{"max_running_requests": running,
                                               **overrides}) as llm:
                def call(bs: int, max_tokens: int) -> int:
                    w = fixed_workload(config["vocab_size"], bs, args.prompt_len, max_tokens,
                                       seed=next(counter))
                    return sum(len(o.token_ids) for o in llm.generate(w.prompts, w.params))

                for bs, rate in cli.decode_rates(
                        {bs: (lambda t, bs=bs: call(bs, t)) for bs in args.batch_sizes},
                        args.new_tokens, args.repeats).items():
                    rates[label, bs] = rate
                    print(f"{label}, batch {bs}: {rate.per_s:.1f} tok/s", flush=True)
    steps, first = args.new_tokens - 1, cli.variants(args)[0][0]
    rows = [[label, str(bs), str(args.new_tokens), f"{r.per_s:.1f}",
             f"{1e3 * r.seconds / steps:.3f}",
             *([f"{roof.tokens_per_s:.1f}", cli.percent(r.per_s / roof.tokens_per_s)]
               if bs == 1 else ["-", "-"]), f"{r.per_s / rates[first, bs].per_s:.2f}x"]
            for (label, bs), r in rates.items()]
    step_bytes = roof.weights.per_decode_step(1)
    cli.report(args, "batch 1 against the roofline; each run against the first at its batch size",
               HEADER, rows, config, [
                   f"copy bandwidth (read + write): {cli.human_bytes(roof.bandwidth)}/s; weight "
                   f"bytes a batch-1 step reads (rank 0, embedding table excluded, LM head "
                   f"once): {cli.human_bytes(step_bytes)}; floor "
                   f"{1e3 * step_bytes / roof.bandwidth:.3f} ms/step",
                   f"prompts of {args.prompt_len} random tokens; decode = t(max_tokens="
                   f"{args.new_tokens}) - t(max_tokens=1); best of {args.repeats}"])
