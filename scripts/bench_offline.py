"""Offline throughput on the anchor workload: one `LLM.generate` call, prefill included.

The anchor workload (`minisgl_backend.benchmark.workloads.anchor_workload`), drawn exactly as
upstream mini-sglang's benchmark/offline/bench.py draws it: `--num-requests` requests (256), prompt
lengths and then output lengths uniform in [100, 1024], prompt ids uniform in [0, 10000]
(`random.Random(seed)`; 142,827 input and 133,966 output tokens), temperature 0.6, ignore_eos,
max_tokens = the output length. After a short warm-up, all of them go through one `generate`
call, and

    output tok/s = requested output tokens / wall time of that call.

The model folder holds the shape's benchmark tokenizer (`minisgl_backend.benchmark.tokenizer`:
Llama 3's for the Llama-3.1-8B shape, a word-level one over the vocabulary otherwise), so every
generated token is detokenized inside the timed call, as upstream and serving do (`generate`
takes whole outputs: each request's text is decoded at its end, in one go).
`--detokenize off` leaves the tokenizer out; `--detokenize both` runs off, then on (a fresh
engine each) and prints what the detokenizer costs, end to end and alone (this process
detokenizing the same outputs again token by token, as for a stream); `--detokenize replay`
runs no engine, only the detokenizer on random outputs of the workload's lengths (its CPU
time, on any machine). Each run also prints this process's garbage collections inside its
timed call.

    python scripts/bench_offline.py                            # Llama-3.1-8B shape on the GPU
    python scripts/bench_offline.py --shape qwen3-30b-a3b --tp-size 2
    python scripts/bench_offline.py --device cpu --shape tiny-qwen3 --num-requests 4 \
        --min-len 4 --max-len 16 --detokenize both              # smoke test
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minisgl_backend.benchmark.cli import (
    add_llm_args,
    add_model_args,
    engine_dtype,
    llm_kwargs,
    markdown_table,
    model_folder,
    print_header,
)
from minisgl_backend.benchmark.collector import CollectorPauses, collector_pauses
from minisgl_backend.benchmark.shapes import shape_config
from minisgl_backend.benchmark.tokenizer import tokenizer_name
from minisgl_backend.benchmark.workloads import (
    Workload,
    anchor_workload,
    fixed_workload,
    random_tokens,
)
from minisgl_backend.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from minisgl_backend import GenerationOutput

HEADER = ("shape", "detokenize", "requests", "input tokens", "output tokens", "total s",
          "output tok/s")
SETTINGS = {"on": (True,), "off": (False,), "both": (False, True)}  # the runs, by --detokenize


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
    parser.add_argument("--detokenize", choices=(*SETTINGS, "replay"), default="on",
                        help="with the shape's tokenizer in the model folder (on), without "
                             "(off), both runs (off first), or replay: no engine, the "
                             "detokenizer alone on random outputs")
    return parser.parse_args(argv)


@dataclass
class Run:
    """One timed `generate` of the workload; `tokenizer` is the engine's (None: no text)."""

    seconds: float
    outputs: list[GenerationOutput]
    tokenizer: Any
    collector: CollectorPauses  # this process's garbage collections during the timed call

    @property
    def chars(self) -> int:
        return sum(len(o.text) for o in self.outputs)


def timed_run(args: argparse.Namespace, workload: Workload, detokenize: bool) -> Run:
    """A fresh `LLM` (with or without the shape's tokenizer), a warm-up, then one timed
    `generate` of the workload."""
    from minisgl_backend import LLM

    with model_folder(args, tokenizer=detokenize) as (folder, config), \
            LLM(folder, **llm_kwargs(args)) as llm:
        warmup = fixed_workload(config["vocab_size"], 8, 32, 8, seed=args.seed + 1)
        llm.generate(warmup.prompts, warmup.params)
        with collector_pauses() as pauses:
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, workload.params)
            seconds = time.perf_counter() - start
        run = Run(seconds, outputs, llm.tokenizer, pauses)
    generated = sum(len(o.token_ids) for o in outputs)
    if generated != workload.output_tokens:
        raise RuntimeError(f"generated {generated} tokens, requested {workload.output_tokens}")
    if detokenize and run.chars == 0:
        raise RuntimeError("a tokenizer was in the model folder but no output has text")
    return run


def detokenize_alone(tokenizer: Any, prompts: Sequence[Sequence[int]],
                     outputs: Sequence[Sequence[int]]) -> float:
    """Seconds this process takes to detokenize `outputs` token by token, as the scheduler does
    for a streaming request (one `IncrementalDetokenizer` per request, given its prompt): the
    detokenizer's CPU time without the engine around it."""
    start = time.perf_counter()
    for prompt, output in zip(prompts, outputs):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        for token in output:
            detokenizer.push([token])
        detokenizer.flush()
    return time.perf_counter() - start


def replay(args: argparse.Namespace, workload: Workload) -> float:
    """`detokenize_alone` on random output ids of the workload's output lengths (no engine),
    with the tokenizer `LLM` would load from the model folder."""
    from transformers import AutoTokenizer

    with model_folder(args, tokenizer=True) as (folder, config):
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(args.seed + 2)
    outputs = [random_tokens(rng, config["vocab_size"], p.max_tokens) for p in workload.params]
    return detokenize_alone(tokenizer, workload.prompts, outputs)


def report(args: argparse.Namespace, config: dict[str, Any], workload: Workload,
           runs: dict[bool, Run]) -> None:
    print()
    print_header(args, config, engine_dtype(args, config))
    settings = {k: v for k, v in llm_kwargs(args).items() if k not in ("device", "dtype")}
    print(f"anchor workload: {len(workload)} requests, lengths uniform in [{args.min_len}, "
          f"{args.max_len}], seed {args.seed}, temperature {args.temperature}; "
          f"LLM settings {settings}")
    tokens = workload.output_tokens
    if True in runs:
        print(f"detokenize on: tokenizer {tokenizer_name(args.shape)!r}, "
              f"{runs[True].chars:,} characters of text")
    if len(runs) == 2:
        off, on = runs[False].seconds, runs[True].seconds
        alone = detokenize_alone(runs[True].tokenizer, workload.prompts,
                                 [o.token_ids for o in runs[True].outputs])
        print(f"detokenizer cost: {on - off:+.3f} s, {(on - off) / off:+.1%} of the time without "
              f"it ({1e6 * (on - off) / tokens:+.2f} us per output token); the detokenizer "
              f"alone in this process: {alone:.3f} s ({1e6 * alone / tokens:.2f} us per token)")
    for detok, run in runs.items():
        print(f"garbage collector, detokenize {'on' if detok else 'off'} (this process, in the "
              f"timed call): {run.collector.describe()}")
    print()
    rows = [[args.shape, "on" if detok else "off", str(len(workload)),
             str(workload.input_tokens), str(tokens), f"{run.seconds:.3f}",
             f"{tokens / run.seconds:.1f}"] for detok, run in runs.items()]
    print(markdown_table(HEADER, rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = shape_config(args.shape, args.num_layers)
    workload = anchor_workload(config["vocab_size"], args.num_requests, args.min_len,
                               args.max_len, args.seed, args.temperature)
    if args.detokenize == "replay":
        seconds = replay(args, workload)
        print_header(args, config, engine_dtype(args, config))
        print(f"the detokenizer alone, tokenizer {tokenizer_name(args.shape)!r}, random outputs "
              f"of the anchor workload ({len(workload)} requests, {workload.output_tokens} "
              f"tokens): {seconds:.3f} s, {1e6 * seconds / workload.output_tokens:.2f} us per "
              f"token")
        return
    runs = {detok: timed_run(args, workload, detok) for detok in SETTINGS[args.detokenize]}
    report(args, config, workload, runs)


if __name__ == "__main__":
    main()
