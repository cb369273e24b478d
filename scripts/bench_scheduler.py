"""The scheduler's own host time per step, with an engine that answers at once (no model).

On the GPU the scheduler's work per step sits between two engine steps: with overlap on, the
engine launches step N+2 only once the scheduler has processed the tokens of step N and sent
N+2, so when that turnaround is longer than a decode step the GPU waits (the Qwen3-0.6B
offline run, benchmark/RESULTS.md). This runs the anchor workload (or any size of it) through
the real `Scheduler` with `InstantEngine` in place of the engine processes and reports the
wall time per step and per output token: all of it is scheduler work (plus the stand-in's
message decoding, a few microseconds a step).

    python scripts/bench_scheduler.py                          # 256 requests, lengths 100-1024
    python scripts/bench_scheduler.py --num-requests 8 --min-len 4 --max-len 16   # smoke test
    MINISGL_PROFILE_DIR=/tmp/prof python scripts/bench_scheduler.py   # + the thread's cProfile

`--guided-batch B` measures a guided decode step's host work instead: B requests of Llama 3's
tokenizer (128,256 ids), `--max-tokens` each, unguided and under bench_structured_output's JSON
schema, with text detokenized as the `LLM` does; a guided row's token is a random one its mask
allows (the stand-in's time for that is taken out). Per decode step: the time of the run less
that of a run of 1 token each, over the steps between. With overlap, a guided step's turnaround
(the step's tokens in, its grammars advanced, the next masks filled) lies between a step's
sampling and the next one's: past a decode step's device time, the GPU waits.
`--grammar-workers` compares numbers of mask-fill worker processes (`grammar.fill_pool`).

    python scripts/bench_scheduler.py --guided-batch 64 --max-tokens 256 --grammar-workers 0 4
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from pathlib import Path
from typing import Any

from minisgl_backend.benchmark.cli import markdown_table
from minisgl_backend.benchmark.tokenizer import committed_tokenizer
from minisgl_backend.benchmark.workloads import anchor_workload
from minisgl_backend.core import SamplingParams
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.grammar import guide
from minisgl_backend.scheduler import RequestOutput, Scheduler, SchedulerConfig
from minisgl_backend.testing.instant_engine import InstantEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_structured_output as structured  # its JSON schema and request parameters

HEADER = ("requests", "output tokens", "steps", "page", "overlap", "outputs", "total s",
          "us/step", "us/output token")
GUIDED_HEADER = ("batch", "config", "fill workers", "overlap", "outputs", "steps", "us/step",
                 "vs unguided")
GUIDED_VOCAB = 128256  # Llama 3's tokenizer, exactly
OUTPUTS = ("stream", "whole")  # the scheduler's outputs: per token, or per request at its end


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="input and output lengths")
    parser.add_argument("--max-len", type=int, default=1024, help="input and output lengths")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--guided-batch", type=int, default=None,
                        help="time this many JSON-schema requests against unguided ones")
    parser.add_argument("--max-tokens", type=int, default=256, help="with --guided-batch")
    parser.add_argument("--fill-threads", type=int, default=None,
                        help="with --guided-batch: fill the masks on this many threads (at most "
                        "half the usable CPUs; default: guide.fill_threads' choice)")
    parser.add_argument("--grammar-workers", type=int, nargs="+", default=[0, 4],
                        help="with --guided-batch: time the JSON-schema runs with each of these "
                        "numbers of mask-fill worker processes")
    parser.add_argument("--outputs", nargs="+", choices=OUTPUTS, default=list(OUTPUTS),
                        help="stream: an output per token (a streaming request); whole: one "
                        "output per request at its end (LLM.generate, a non-streaming request)")
    return parser.parse_args(argv)


def drive(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams, Any]],
          outputs: str) -> tuple[float, int, list[str]]:
    """Submit every (prompt, params, checked or None) request, its outputs streamed or whole
    (`outputs`), wait for all to finish, shut the scheduler down: (seconds, output tokens,
    errors)."""
    remaining, done, tokens, errors = len(requests), threading.Event(), 0, []

    def on_output(out: RequestOutput) -> None:  # on the scheduler thread
        nonlocal remaining, tokens
        tokens += len(out.token_ids)
        if out.error is not None:
            errors.append(out.error)
        if out.finished:
            remaining -= 1
            if remaining == 0:
                done.set()

    try:
        start = time.perf_counter()
        for prompt, params, checked in requests:
            scheduler.submit(prompt, params, on_output, checked, stream=outputs == "stream")
        if not done.wait(timeout=600):
            raise RuntimeError(f"{remaining} requests did not finish")
        seconds = time.perf_counter() - start
    finally:
        scheduler.shutdown()
    return seconds, tokens, errors


def run_once(args: argparse.Namespace, page_size: int, overlap: bool, outputs: str
             ) -> tuple[float, int, int]:
    """(seconds, output tokens, steps) of one pass of the workload through a fresh scheduler."""
    workload = anchor_workload(args.vocab_size, args.num_requests, args.min_len, args.max_len)
    longest = max(len(p) + s.max_tokens for p, s in zip(workload.prompts, workload.params))
    pages = sum(-(-(len(p) + s.max_tokens) // page_size) + 1
                for p, s in zip(workload.prompts, workload.params))
    engine = InstantEngine(num_pages=pages, max_seq_len=longest)
    config = SchedulerConfig(
        engine=EngineConfig(model_dir="", page_size=page_size, overlap=overlap,
                            max_running_requests=args.max_running_requests),
        chunked_prefill_size=args.chunked_prefill_size)
    scheduler = Scheduler(config, tokenizer=None, eos_ids=frozenset(),
                          vocab_size=args.vocab_size, engine=engine)  # type: ignore[arg-type]
    requests = [(prompt, params, None) for prompt, params in zip(workload.prompts,
                                                                 workload.params)]
    seconds, tokens, _ = drive(scheduler, requests, outputs)
    if tokens != workload.output_tokens:
        raise RuntimeError(f"{tokens} tokens generated, the workload asks for "
                           f"{workload.output_tokens}")
    return seconds, tokens, engine.steps_received


def run_guided(args: argparse.Namespace, tokenizer: Any, guided: bool, overlap: bool,
               outputs: str, max_tokens: int, workers: int) -> tuple[float, int]:
    """(scheduler seconds, steps) of `--guided-batch` requests of `max_tokens` each, under the
    JSON schema (of `--max-tokens` items) or not, with `workers` mask-fill processes (up
    before the clock starts); the stand-in's time picking allowed tokens is taken out."""
    batch = args.guided_batch
    prompt = tokenizer.encode("List the people you know, as JSON.")
    params = structured.params("json_schema" if guided else "unguided", max_tokens,
                               args.max_tokens)
    engine = InstantEngine(num_pages=batch * (len(prompt) + max_tokens + 1),
                           max_seq_len=len(prompt) + max_tokens + 1, vocab_size=GUIDED_VOCAB)
    config = SchedulerConfig(
        engine=EngineConfig(model_dir="", page_size=1, overlap=overlap,
                            max_running_requests=batch),
        jump_forward=False, grammar_workers=workers)
    scheduler = Scheduler(config, tokenizer=tokenizer,
                          eos_ids=frozenset({tokenizer.eos_token_id}), vocab_size=GUIDED_VOCAB,
                          engine=engine)  # type: ignore[arg-type]
    # Compiled once before timing, as a server's cache would hold it.
    checked = scheduler.check_request(prompt, params)
    if guided and scheduler.fill_pool is not None:
        scheduler.fill_pool.start(checked.grammar.tokenizer_info)
        if not scheduler.fill_pool.wait_ready(300):
            raise RuntimeError("the mask-fill workers did not start")
    seconds, tokens, errors = drive(scheduler, [(prompt, params, checked)] * batch, outputs)
    if errors or tokens != batch * max_tokens:
        raise RuntimeError(f"{tokens} tokens of {batch * max_tokens}; errors: {errors[:3]}")
    pool = scheduler.fill_pool
    if guided and pool is not None and batch >= pool.min_rows and max_tokens > 1 \
            and not pool.fills:
        raise RuntimeError("the mask-fill workers filled no step")
    return seconds - engine.pick_seconds, engine.steps_received


def main_guided(args: argparse.Namespace) -> None:
    from transformers import PreTrainedTokenizerFast

    if args.fill_threads is not None:
        guide.PARALLEL_FILL_ROWS = 1 if args.fill_threads > 1 else args.guided_batch + 1
        guide.FILL_THREADS_MAX = args.fill_threads

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=committed_tokenizer("llama-3"),
                                        eos_token="<|end_of_text|>")
    workers = args.grammar_workers
    rows = []
    for overlap, outputs in itertools.product((True, False), args.outputs):
        base = None
        for guided, count in [(False, 0)] + [(True, n) for n in workers]:
            # Admission and prefill (a matcher per request) taken out: a 1-token run's time.
            (t_long, n_long), (t_one, n_one) = (
                min(run_guided(args, tokenizer, guided, overlap, outputs, tokens, count)
                    for _ in range(args.repeats)) for tokens in (args.max_tokens, 1))
            steps = n_long - n_one
            per_step = max(t_long - t_one, 1e-9) / steps
            base = base or per_step
            rows.append([str(args.guided_batch), "json_schema" if guided else "unguided",
                         str(count), "on" if overlap else "off", outputs, str(steps),
                         f"{per_step * 1e6:.1f}", f"{per_step / base:.2f}x"])
            print(" | ".join(rows[-1]), flush=True)
    print(f"\nscheduler host time per step with an instant engine ({args.guided_batch} "
          f"requests, {args.max_tokens} tokens each, best of {args.repeats}; mask fills on "
          f"{guide.fill_threads(args.guided_batch)} thread(s))\n")
    print(markdown_table(GUIDED_HEADER, rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.guided_batch is not None:
        main_guided(args)
        return
    rows = []
    for page_size in args.page_sizes:
        for overlap, outputs in itertools.product((True, False), args.outputs):
            seconds, tokens, steps = min(run_once(args, page_size, overlap, outputs)
                                         for _ in range(args.repeats))
            rows.append([str(args.num_requests), str(tokens), str(steps), str(page_size),
                         "on" if overlap else "off", outputs, f"{seconds:.3f}",
                         f"{seconds / steps * 1e6:.1f}", f"{seconds / tokens * 1e6:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    print(f"\nscheduler host time with an instant engine (anchor workload: lengths "
          f"{args.min_len}-{args.max_len}, best of {args.repeats})\n")
    print(markdown_table(HEADER, rows))


if __name__ == "__main__":
    main()
