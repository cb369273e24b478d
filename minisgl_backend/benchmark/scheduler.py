"""The scheduler's own host time per step, with an engine stand-in that answers at once.

With overlap, the engine launches step N+2 once the scheduler has taken step N's tokens and sent
N+2: a turnaround longer than a decode step leaves the device waiting. This runs the anchor
workload (any size of it) through the real `Scheduler` with `InstantEngine` for the engine
processes, per page size, overlap on and off, outputs streamed (per token) or whole (per request,
as `LLM.generate` takes them). `--guided-batch B` times a guided decode step instead: B requests
through Llama 3's tokenizer, unguided and under `structured`'s JSON schema, a guided row's token a
random one its mask allows (the stand-in's time for that taken out); per step: the run's time
less a 1-token run's, over the steps between.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import threading
import time
from typing import Any

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.structured import params as structured_params
from minisgl_backend.benchmark.tokenizer import committed_tokenizer
from minisgl_backend.benchmark.workloads import anchor_workload
from minisgl_backend.core import SamplingParams
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.scheduler import RequestOutput, Scheduler, SchedulerConfig
from minisgl_backend.testing.instant_engine import InstantEngine

HEADER = ("requests", "output tokens", "steps", "page", "overlap", "outputs", "total s",
          "us/step", "us/output token")
GUIDED_HEADER = ("batch", "config", "overlap", "outputs", "steps", "us/step", "vs unguided")
GUIDED_VOCAB = 128256  # Llama 3's tokenizer, exactly
OUTPUTS = ("stream", "whole")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_llm_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="input and output lengths")
    parser.add_argument("--max-len", type=int, default=1024, help="input and output lengths")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--guided-batch", type=int,
                        help="time this many JSON-schema requests against unguided ones")
    parser.add_argument("--max-tokens", type=int, default=256, help="with --guided-batch")
    parser.add_argument("--outputs", nargs="+", choices=OUTPUTS, default=list(OUTPUTS))


def make_scheduler(args: argparse.Namespace, engine: InstantEngine, tokenizer: Any, vocab: int,
                   **overrides: Any) -> Scheduler:
    """A scheduler of the options' engine settings with `overrides`, driving `engine`."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in cli.llm_kwargs(args, **overrides).items()
                             if k in names})
    eos = frozenset() if tokenizer is None else frozenset({tokenizer.eos_token_id})
    return Scheduler(SchedulerConfig(engine=config), tokenizer=tokenizer, eos_ids=eos,
                     vocab_size=vocab, engine=engine)  # type: ignore[arg-type]


def drive(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams, Any]],
          outputs: str) -> tuple[float, int]:
    """Submit every (prompt, params, checked) request, outputs streamed or whole; wait for all;
    shut the scheduler down: (seconds, output tokens)."""
    remaining, done, tokens, errors = [len(requests)], threading.Event(), [0], []

    def on_output(out: RequestOutput) -> None:  # on the scheduler thread
        tokens[0] += len(out.token_ids)
        if out.error is not None:
            errors.append(out.error)
        if out.finished:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    try:
        start = time.perf_counter()
        for prompt, params, checked in requests:
            scheduler.submit(prompt, params, on_output, checked, stream=outputs == "stream")
        if not done.wait(timeout=600):
            raise RuntimeError(f"{remaining[0]} requests did not finish")
        seconds = time.perf_counter() - start
    finally:
        scheduler.shutdown()
    if errors:
        raise RuntimeError(f"errors: {errors[:3]}")
    return seconds, tokens[0]


def run_anchor(args: argparse.Namespace, page_size: int, overlap: bool, outputs: str
               ) -> tuple[float, int, int]:
    """(seconds, output tokens, steps) of the workload through a fresh scheduler."""
    workload = anchor_workload(args.vocab_size, args.num_requests, args.min_len, args.max_len)
    lengths = [len(p) + s.max_tokens for p, s in zip(workload.prompts, workload.params)]
    engine = InstantEngine(num_pages=sum(-(-n // page_size) + 1 for n in lengths),
                           max_seq_len=max(lengths))
    scheduler = make_scheduler(args, engine, None, args.vocab_size, page_size=page_size,
                               overlap=overlap)
    seconds, tokens = drive(scheduler, [(p, s, None) for p, s in zip(workload.prompts,
                                                                      workload.params)], outputs)
    if tokens != workload.output_tokens:
        raise RuntimeError(f"{tokens} tokens generated of {workload.output_tokens}")
    return seconds, tokens, engine.steps_received


def run_guided(args: argparse.Namespace, tokenizer: Any, config: str, overlap: bool,
               outputs: str, max_tokens: int) -> tuple[float, int]:
    """(scheduler seconds, steps) of `--guided-batch` requests of `max_tokens` each, the
    grammar compiled before the clock starts (as a server's cache would hold it)."""
    batch = args.guided_batch
    prompt = tokenizer.encode("List the people you know, as JSON.")
    params = structured_params(config, max_tokens, args.max_tokens)
    engine = InstantEngine(num_pages=batch * (len(prompt) + max_tokens + 1),
                           max_seq_len=len(prompt) + max_tokens + 1, vocab_size=GUIDED_VOCAB)
    scheduler = make_scheduler(args, engine, tokenizer, GUIDED_VOCAB, page_size=1,
                               overlap=overlap, max_running_requests=batch, jump_forward=False)
    checked = scheduler.check_request(prompt, params)
    seconds, tokens = drive(scheduler, [(prompt, params, checked)] * batch, outputs)
    if tokens != batch * max_tokens:
        raise RuntimeError(f"{tokens} tokens of {batch * max_tokens}")
    return seconds - engine.pick_seconds, engine.steps_received


def guided(args: argparse.Namespace) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=committed_tokenizer("llama-3"),
                                        eos_token="<|end_of_text|>")
    rows = []
    for overlap, outputs in itertools.product((True, False), args.outputs):
        base = None
        for config in ("unguided", "json_schema"):
            # Admission and prefill (a matcher per request) taken out: a 1-token run's time.
            (t_long, n_long), (t_one, n_one) = (
                min(run_guided(args, tokenizer, config, overlap, outputs, tokens)
                    for _ in range(args.repeats)) for tokens in (args.max_tokens, 1))
            per_step = max(t_long - t_one, 1e-9) / (n_long - n_one)
            base = base or per_step
            rows.append([str(args.guided_batch), config, "on" if overlap else "off", outputs,
                         str(n_long - n_one), f"{per_step * 1e6:.1f}", f"{per_step / base:.2f}x"])
            print(" | ".join(rows[-1]), flush=True)
    cli.report(args, f"JSON-schema steps against unguided ones ({args.guided_batch} requests, "
               f"{args.max_tokens} tokens each, best of {args.repeats})", GUIDED_HEADER, rows)


def run(args: argparse.Namespace) -> None:
    if args.guided_batch is not None:
        guided(args)
        return
    rows = []
    for page_size, overlap, outputs in itertools.product(args.page_sizes, (True, False),
                                                         args.outputs):
        seconds, tokens, steps = min(run_anchor(args, page_size, overlap, outputs)
                                     for _ in range(args.repeats))
        rows.append([str(args.num_requests), str(tokens), str(steps), str(page_size),
                     "on" if overlap else "off", outputs, f"{seconds:.3f}",
                     f"{seconds / steps * 1e6:.1f}", f"{seconds / tokens * 1e6:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    cli.report(args, f"page sizes, overlap and output modes against each other (anchor "
               f"workload: lengths {args.min_len}-{args.max_len}, best of {args.repeats})",
               HEADER, rows)
