"""Decode throughput with speculative decoding against without, side by side.

With a model (default: the embedded one), two workloads of greedy chat prompts, up to
`--max-tokens` each: `repetitive` ("repeat this passage" requests, whose outputs copy their
input: where draft-free speculation should win) and `chat` (questions, where drafts are rarely
right and speculation must not cost), with speculation off and each of `--methods`.

With `--shape` (random weights, which accept nothing real) the requests are random prompts, and
each `--acceptance` p keeps every draft token with probability p (a benchmark-only hook), so
that verify steps cost, and yield, what a real run with that acceptance would.

One engine per configuration, in turn. Decode tok/s takes prefill out as `decode` does, from
the tokens counted; acceptance = draft tokens kept / verified; the batch-1 roofline as in
`decode`.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.hardware import measure_roofline
from minisgl_backend.benchmark.workloads import (Workload, chat_text, fixed_workload, repeat_text,
                                                 text_workload)
from minisgl_backend.models import ModelConfig

HEADER = ("workload", "batch", "config", "tokens", "decode tok/s", "vs off", "acceptance",
          "of roofline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", choices=("ngram", "suffix"),
                        help="default: ngram and suffix; with --shape ngram")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.8],
                        help="with --shape: synthetic acceptance probabilities")
    parser.add_argument("--num-speculative-tokens", type=int)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32, help="with --shape")
    parser.add_argument("--repeats", type=int, default=2)


def configurations(args: argparse.Namespace) -> dict[str, tuple[dict[str, Any], float | None]]:
    """Name -> (the `LLM` settings, the synthetic acceptance)."""
    methods = args.methods or (["ngram"] if args.shape else ["ngram", "suffix"])
    k = {} if args.num_speculative_tokens is None else {
        "num_speculative_tokens": args.num_speculative_tokens}
    configs: dict[str, tuple[dict[str, Any], float | None]] = {"off": ({}, None)}
    for method in methods:
        if args.shape is None:
            configs[method] = ({"speculative": method, **k}, None)
        for p in args.acceptance if args.shape else ():
            configs[f"{method} p={p}"] = ({"speculative": method, **k}, p)
    return configs


def run(args: argparse.Namespace) -> None:
    results, kept = {}, {}
    with cli.model_folder(args, tokenizer=False) as (folder, config):
        roof = measure_roofline(ModelConfig.from_dict(config), cli.engine_dtype(args, config),
                                cli.torch_device(args), args.tp_size or 1)
        workloads = ("random",) if args.shape else ("repetitive", "chat")
        running = max(args.max_running_requests or 0, *args.batch_sizes)
        for name, (settings, acceptance) in configurations(args).items():
            with cli.make_llm(args, folder, acceptance, max_running_requests=running,
                              **settings) as llm:
                rounds = itertools.count()  # the same prompts, in turn, for every engine

                def make(workload: str, bs: int, tokens: int) -> Workload:
                    first = bs * (next(rounds) if tokens == args.max_tokens else 0)
                    if workload == "random":
                        return fixed_workload(config["vocab_size"], bs, args.prompt_len, tokens,
                                              seed=first)
                    text = repeat_text if workload == "repetitive" else chat_text
                    return text_workload(llm.tokenizer, [text(first + i) for i in range(bs)],
                                         tokens, ignore_eos=False)

                def call(key: tuple[str, int], tokens: int) -> int:
                    w = make(*key, tokens)
                    outs = llm.generate(w.prompts, w.params)
                    counts = kept.setdefault((name, *key), [0, 0])
                    counts[0] += sum(o.draft_tokens for o in outs)
                    counts[1] += sum(o.accepted_draft_tokens for o in outs)
                    return sum(len(o.token_ids) for o in outs)

                keys = [(w, bs) for bs in args.batch_sizes for w in workloads]
                rates = cli.decode_rates({k: (lambda t, k=k: call(k, t)) for k in keys},
                                         args.max_tokens, args.repeats)
                for key, rate in rates.items():
                    results[(*key, name)] = rate
                    print(f"{name}, {key[0]}, batch {key[1]}: {rate.per_s:.1f} tok/s", flush=True)
    rows = []
    order = sorted(results, key=lambda key: (key[1], workloads.index(key[0])))  # stable: configs
    for workload, bs, name in order:
        rate = results[workload, bs, name]
        drafted, accepted = kept[name, workload, bs]
        rows.append([workload, str(bs), name, str(rate.tokens), f"{rate.per_s:.1f}",
                     f"{rate.per_s / results[workload, bs, 'off'].per_s:.2f}x",
                     f"{accepted / drafted:.2f}" if drafted else "-",
                     cli.percent(rate.per_s / roof.tokens_per_s) if bs == 1 else "-"])
    cli.report(args, f"each configuration against speculation off at the same batch size "
               f"(greedy, max_tokens {args.max_tokens}, best of {args.repeats} rounds); batch 1 "
               f"against the {roof.tokens_per_s:.1f} tok/s roofline", HEADER, rows, config)
