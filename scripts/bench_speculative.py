"""Decode throughput with speculative decoding against without, side by side in one run.

Random-weight models of real shapes (`load_format="dummy"`) accept nothing real, so the
speculative configurations use the benchmark-only `speculative_synthetic_acceptance`: each
step drafts `--num-speculative-tokens` tokens per row (the n-gram proposer, padded) and keeps
each with the given probability, so the verify steps' cost and the tokens they yield are those
of a real run with that acceptance. Per batch size and configuration (one engine each, made in
turn): decode tok/s = (tokens(N) - tokens(1)) / (best t(N) - best t(1)) over `--repeats`
calls of random prompts, and the batch-1 bandwidth roofline (the weight bytes a step reads over
the measured copy bandwidth) measured in the same run.

    python scripts/bench_speculative.py                    # Llama-3.1-8B shape on the GPU
    python scripts/bench_speculative.py --device cpu --shape tiny-llama --new-tokens 16
"""

from __future__ import annotations

import argparse
import time

from minisgl_backend import LLM
from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.hardware import measure_roofline
from minisgl_backend.benchmark.workloads import fixed_workload
from minisgl_backend.models import ModelConfig

HEADER = ("batch", "config", "decode tok/s", "vs off", "kept per verify", "of roofline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.8],
                        help="synthetic acceptance probabilities (one configuration each)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args(argv)


def measure(llm: LLM, args: argparse.Namespace, vocab: int, bs: int) -> tuple[float, float]:
    """(decode tok/s, draft tokens kept per verifying row) at batch size `bs`."""
    spec = llm.scheduler.speculator

    def best(max_tokens: int) -> tuple[float, int]:
        runs = []
        for r in range(args.repeats):
            w = fixed_workload(vocab, bs, args.prompt_len, max_tokens, seed=1000 * bs + r)
            start = time.perf_counter()
            outs = llm.generate(w.prompts, w.params)
            runs.append((time.perf_counter() - start, sum(len(o.token_ids) for o in outs)))
        return min(runs)

    best(2)  # warm up this batch size
    rows_before, kept_before = spec.verified_rows, spec.accepted
    (t_long, n_long), (t_one, n_one) = best(args.new_tokens), best(1)
    rows = spec.verified_rows - rows_before
    kept = (spec.accepted - kept_before) / rows if rows else 0.0
    return (n_long - n_one) / max(t_long - t_one, 1e-9), kept


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs: list[tuple[str, dict]] = [("off", {})] + [
        (f"ngram k={args.num_speculative_tokens} p={p}",
         {"speculative": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
          "speculative_synthetic_acceptance": p}) for p in args.acceptance]
    with cli.model_folder(args) as (folder, config):
        dtype = cli.engine_dtype(args, config)
        roof = measure_roofline(ModelConfig.from_dict(config), dtype, cli.torch_device(args),
                                args.tp_size or 1)
        results: dict[tuple[int, str], tuple[float, float]] = {}
        for name, settings in configs:
            kwargs = cli.llm_kwargs(args, **settings)
            kwargs["max_running_requests"] = max(kwargs.get("max_running_requests", 0),
                                                 *args.batch_sizes)
            with LLM(folder, **kwargs) as llm:
                for bs in args.batch_sizes:
                    results[(bs, name)] = measure(llm, args, config["vocab_size"], bs)
                    print(f"{name} batch {bs}: {results[(bs, name)][0]:.1f} tok/s", flush=True)
        print()
        cli.print_header(args, config, dtype)
        step_bytes = cli.human_bytes(roof.weights.per_decode_step(1))
        print(f"copy bandwidth {cli.human_bytes(roof.bandwidth)}/s; batch-1 roofline "
              f"{roof.tokens_per_s:.1f} tok/s ({step_bytes} of weights per step); "
              f"decode over {args.new_tokens - 1} steps, best of {args.repeats}")
        rows = []
        for bs in args.batch_sizes:
            base = results[(bs, "off")][0]
            for name, _ in configs:
                rate, kept = results[(bs, name)]
                rows.append([str(bs), name, f"{rate:.1f}", f"{rate / base:.2f}x",
                             f"{kept:.2f}" if name != "off" else "-",
                             cli.percent(rate / roof.tokens_per_s) if bs == 1 else "-"])
        print(cli.markdown_table(HEADER, rows))


if __name__ == "__main__":
    main()
