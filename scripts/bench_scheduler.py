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
"""

from __future__ import annotations

import argparse
import threading
import time

from minisgl_backend.benchmark.cli import markdown_table
from minisgl_backend.benchmark.workloads import anchor_workload
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.scheduler import RequestOutput, Scheduler, SchedulerConfig
from minisgl_backend.testing.instant_engine import InstantEngine

HEADER = ("requests", "output tokens", "steps", "page", "overlap", "total s", "us/step",
          "us/output token")


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
    return parser.parse_args(argv)


def run_once(args: argparse.Namespace, page_size: int, overlap: bool) -> tuple[float, int, int]:
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
    remaining = len(workload)
    done = threading.Event()
    tokens = 0

    def on_output(out: RequestOutput) -> None:  # on the scheduler thread
        nonlocal remaining, tokens
        tokens += len(out.token_ids)
        if out.finished:
            remaining -= 1
            if remaining == 0:
                done.set()

    try:
        start = time.perf_counter()
        for prompt, params in zip(workload.prompts, workload.params):
            scheduler.submit(prompt, params, on_output)
        if not done.wait(timeout=600):
            raise RuntimeError(f"{remaining} requests did not finish")
        seconds = time.perf_counter() - start
    finally:
        scheduler.shutdown()
    if tokens != workload.output_tokens:
        raise RuntimeError(f"{tokens} tokens generated, the workload asks for "
                           f"{workload.output_tokens}")
    return seconds, tokens, engine.steps_received


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for page_size in args.page_sizes:
        for overlap in (True, False):
            seconds, tokens, steps = min(run_once(args, page_size, overlap)
                                         for _ in range(args.repeats))
            rows.append([str(args.num_requests), str(tokens), str(steps), str(page_size),
                         "on" if overlap else "off", f"{seconds:.3f}",
                         f"{seconds / steps * 1e6:.1f}", f"{seconds / tokens * 1e6:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    print(f"\nscheduler host time with an instant engine (anchor workload: lengths "
          f"{args.min_len}-{args.max_len}, best of {args.repeats})\n")
    print(markdown_table(HEADER, rows))


if __name__ == "__main__":
    main()
