"""Decode throughput with structured output (a JSON schema) against without, side by side.

Per batch size B, each call generates for B chat prompts (a different question each) with
ignore_eos, in the configurations `unguided` (greedy), `json_schema` (the same requests under a
schema of an array of at least T objects, so that no request can close it early: every
configuration computes the same tokens) and `json_schema+jump` (a second engine with
jump-forward: the tokens the grammar forces are verified as drafts in one step). Decode tok/s
takes prefill out as `decode` does, from the tokens counted (best of `--repeats` interleaved
rounds). Before the table: each schema's compile time, first and cached.

A grammar needs a tokenizer that spells JSON: a shape's word-level tokenizer does not
(`--tokenizer llama-3`). xgrammar counts the ids a tokenizer lacks as special tokens and its
accepts slow with their number, so Llama 3's tokens on the Qwen3 shape go with
`--vocab-size 128256`. With random weights the schema decides every token's structure; the
masks, their application and jump-forward cost what they cost with a real model.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.tokenizer import WORD_LEVEL, tokenizer_name
from minisgl_backend.benchmark.workloads import chat_text, encode_text
from minisgl_backend.core import SamplingParams

HEADER = ("batch", "config", "tokens", "decode tok/s", "ms/step", "vs unguided")
CONFIGS = ("unguided", "json_schema", "json_schema+jump")
PEOPLE = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]}},
    "required": ["name", "age", "city"]}}
COMPILED = {  # schemas whose compile time is reported
    "people (array of objects)": PEOPLE,
    "nested object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["id"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "string formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}, "required": ["day"]},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="only these (one alone: a step timeline of it, "
                             "MINISGL_STEP_TIMES_DIR); ratios need unguided")


def params(config: str, max_tokens: int, min_items: int) -> SamplingParams:
    """A request of `config`; its schema's array needs `min_items` objects at least."""
    guide = ({"json_schema": {**PEOPLE, "minItems": min_items}}
             if config.startswith("json_schema") else {})
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **guide)


def run(args: argparse.Namespace) -> None:
    if args.shape is not None and (args.tokenizer or tokenizer_name(args.shape)) == WORD_LEVEL:
        raise SystemExit(f"shape {args.shape}'s word-level tokenizer cannot spell JSON: give "
                         f"--tokenizer")
    configs = [c for c in CONFIGS if c in args.configs]
    jumped = [0, 0]  # forced tokens verified as drafts, and of them kept
    with cli.model_folder(args) as (folder, config), ExitStack() as stack:
        # An engine without jump-forward and one with, each only when asked for (an idle
        # engine still holds the GPU).
        engines = {jump: stack.enter_context(cli.make_llm(args, folder, jump_forward=jump))
                   for jump in dict.fromkeys(c.endswith("+jump") for c in configs)}
        llm = next(iter(engines.values()))
        for name, schema in COMPILED.items():
            times = []
            for _ in range(2):
                start = time.perf_counter()
                llm.scheduler.grammars.compile(SamplingParams(json_schema=schema))
                times.append(time.perf_counter() - start)
            print(f"compile {name}: first {1e3 * times[0]:.2f} ms, cached "
                  f"{1e3 * times[1]:.3f} ms", flush=True)
        prompts = {bs: [encode_text(llm.tokenizer, chat_text(i, context=False))
                        for i in range(bs)] for bs in args.batch_sizes}

        def call(bs: int, config: str, max_tokens: int) -> int:
            outs = engines[config.endswith("+jump")].generate(
                prompts[bs], params(config, max_tokens, args.max_tokens))
            if config.endswith("+jump"):
                jumped[0] += sum(o.draft_tokens for o in outs)
                jumped[1] += sum(o.accepted_draft_tokens for o in outs)
            return sum(len(o.token_ids) for o in outs)

        rates = cli.decode_rates({(bs, c): (lambda t, bs=bs, c=c: call(bs, c, t))
                                  for bs in args.batch_sizes for c in configs},
                                 args.max_tokens, args.repeats)
    rows = []
    for (bs, name), rate in rates.items():
        base = rates.get((bs, "unguided"))
        rows.append([str(bs), name, str(rate.tokens), f"{rate.per_s:.1f}",
                     f"{1e3 * rate.seconds / max(1, args.max_tokens - 1):.2f}",
                     f"{rate.per_s / base.per_s:.3f}x" if base else "-"])
    notes = [f"jump-forward: {jumped[1]} of {jumped[0]} forced tokens kept"] if jumped[0] else []
    cli.report(args, f"each configuration against unguided at the same batch size (chat "
               f"prompts, max_tokens {args.max_tokens}, best of {args.repeats} rounds)", HEADER,
               rows, config, notes)
