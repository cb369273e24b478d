"""Decode throughput with the per-request sampling controls on against off, in one engine.

Per batch size B the configurations are `none` (temperature 0.7, a seed per request) and `all`
(the same with every control: repetition_penalty 1.1, presence_penalty 0.3, frequency_penalty
0.2, min_p 0.05, 50 logit_bias entries, bad_token_ids of 3 single tokens and 3 sequences of 2-3
tokens, logprobs 5); `--each` adds every control alone, `--configs` picks some. Each call runs
B prompts of `--prompt-len` random tokens (fresh ones each call), with ignore_eos; decode tok/s
takes prefill out as `decode` does (the calls of T and of 1 tokens, best of `--repeats`
interleaved rounds). The prefix cache is the naive one unless `--cache` says otherwise: random
prompts never share a prefix, and a radix cache filled by earlier calls would make later ones
pay for its eviction. Before the table: the device state the controls allocate per engine table
row, measured on a small `LogitControls` on the CPU (so it follows the dtypes of
engine/controls.py).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.workloads import random_tokens
from minisgl_backend.core import SamplingParams
from minisgl_backend.engine.config import EngineConfig

HEADER = ("batch", "config", "decode tok/s", "ms/step", "vs none")
TEMPERATURE, BIAS_ENTRIES = 0.7, 50
MEMORY_ROWS, MEMORY_VOCAB = 256, 152_064  # the memory line's example: Qwen2.5's vocabulary


def controls(vocab: int) -> dict[str, dict[str, Any]]:
    """Each control's settings (token ids drawn once from a fixed seed within `vocab`)."""
    rng = random.Random(0)
    ids = rng.sample(range(vocab), BIAS_ENTRIES + 12)
    rest = ids[BIAS_ENTRIES:]
    return {
        "repetition_penalty": {"repetition_penalty": 1.1},
        "presence_penalty": {"presence_penalty": 0.3},
        "frequency_penalty": {"frequency_penalty": 0.2},
        "min_p": {"min_p": 0.05},
        "logit_bias": {"logit_bias": {t: round(rng.uniform(-2.0, 2.0), 3)
                                      for t in ids[:BIAS_ENTRIES]}},
        "bad_token_ids": {"bad_token_ids": [[rest[0]], [rest[1]], [rest[2]], rest[3:5],
                                            rest[5:7], rest[7:10]]},
        "logprobs": {"logprobs": 5},
    }


def configurations(vocab: int, each: bool) -> dict[str, dict[str, Any]]:
    """Name -> the SamplingParams fields beside max_tokens, temperature, seed and ignore_eos."""
    per_control = controls(vocab)
    every = {k: v for settings in per_control.values() for k, v in settings.items()}
    return {"none": {}, "all": every, **(per_control if each else {})}


def state_bytes_per_row(vocab: int, settings: dict[str, Any]) -> dict[str, int]:
    """Bytes per table row of each device tensor the controls allocate for a request with
    `settings`: one is admitted to a 2-row `LogitControls` on the CPU, as the engine does."""
    from minisgl_backend.core import Req
    from minisgl_backend.engine.controls import LogitControls
    from minisgl_backend.engine.protocol import StepMessage
    from minisgl_backend.scheduler.scheduler import add_admission

    rows, p = 2, SamplingParams(**settings)
    req = Req(uid=0, input_ids=[0], prompt_len=1, sampling_params=p, seed=0, table_idx=0)
    req.bans = tuple(tuple(seq) for seq in p.bad_token_ids)
    msg = StepMessage(is_prefill=True, rows=[0])
    add_admission(msg, req, [], vocab)
    state = LogitControls(rows, vocab, torch.zeros((rows, 8), dtype=torch.int32))
    state.admit(StepMessage.from_bytes(msg.to_bytes()))  # numpy arrays, as the engine's
    tensors = {"counts": state.counts, "in_prompt": state.in_prompt, "bias_ids": state.bias_ids,
               "bias_values": state.bias_values, "ban_tokens": state.ban_tokens}
    return {name: t.nbytes // rows for name, t in tensors.items()}


def memory_line(vocab: int, engine_rows: int) -> str:
    """The controls' device state per row with the "all" settings."""
    per_row = state_bytes_per_row(MEMORY_VOCAB, configurations(MEMORY_VOCAB, False)["all"])
    penalties = per_row["counts"] + per_row["in_prompt"]  # scales with the vocabulary
    others = sum(per_row.values()) - penalties
    rows = MEMORY_ROWS
    return (f"device state of the controls (allocated on first use for every table row, "
            f"max_running_requests + 1), at {rows} rows and V = {MEMORY_VOCAB:,}: penalties "
            f"{penalties:,} B/row = {cli.human_bytes(rows * penalties)}; logit_bias "
            f"({BIAS_ENTRIES} entries) and bad_token_ids as benchmarked {others:,} B/row; this "
            f"engine ({engine_rows} rows, V = {vocab:,}): "
            f"{cli.human_bytes(engine_rows * (penalties * vocab // MEMORY_VOCAB + others))}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    parser.set_defaults(cache="naive")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64, help="T, for every batch size")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best is kept")
    parser.add_argument("--each", action="store_true", help="also every control alone")
    parser.add_argument("--configs", nargs="+", choices=list(configurations(1000, each=True)),
                        help="only these configurations (e.g. one per run, for a step timeline "
                             "of each: MINISGL_STEP_TIMES_DIR)")


def run(args: argparse.Namespace) -> None:
    if args.max_tokens < 2:
        raise SystemExit("--max-tokens must be >= 2 (one decode step at least)")
    with cli.model_folder(args, tokenizer=False) as (folder, config):
        vocab = config["vocab_size"]
        configs = configurations(vocab, args.each or args.configs is not None)
        configs = {name: configs[name] for name in args.configs or configs}
        running = max(args.max_running_requests or EngineConfig().max_running_requests,
                      *args.batch_sizes)
        memory = memory_line(vocab, running + 1)  # before the timing: it fails early
        rng = random.Random(1234)
        with cli.make_llm(args, folder, max_running_requests=running) as llm:
            def call(bs: int, settings: dict[str, Any], max_tokens: int) -> int:
                prompts = [random_tokens(rng, vocab, args.prompt_len) for _ in range(bs)]
                params = [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, seed=i,
                                         ignore_eos=True, **settings) for i in range(bs)]
                outs = llm.generate(prompts, params)
                top = settings.get("logprobs")
                if any(len(o.token_ids) != max_tokens or top is not None and (
                        len(o.logprobs or ()) != max_tokens
                        or any(len(t) != top for t in o.top_logprobs)) for o in outs):
                    raise RuntimeError("a request missed tokens or log-probabilities")
                return sum(len(o.token_ids) for o in outs)

            rates = cli.decode_rates({(bs, name): (lambda t, bs=bs, s=settings: call(bs, s, t))
                                      for bs in args.batch_sizes
                                      for name, settings in configs.items()},
                                     args.max_tokens, args.repeats)
    rows = []
    for (bs, name), rate in rates.items():
        base = rates.get((bs, "none"))
        rows.append([str(bs), name, f"{rate.per_s:.1f}",
                     f"{1e3 * rate.seconds / (args.max_tokens - 1):.3f}",
                     f"{rate.per_s / base.per_s:.2f}x" if base else "-"])
    cli.report(args, f"each configuration against none at the same batch size (temperature "
               f"{TEMPERATURE}, prompts of {args.prompt_len} random tokens, decode = t(max_tokens="
               f"{args.max_tokens}) - t(max_tokens=1), best of {args.repeats} rounds)", HEADER,
               rows, config, [memory])
