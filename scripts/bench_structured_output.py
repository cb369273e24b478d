"""Decode throughput with and without structured output (a JSON schema), side by side.

One `LLM` serves both configurations. Per batch size B, each call generates for B chat prompts
(a different question each, so that outputs differ) with `ignore_eos`:

* unguided: plain greedy decoding, exactly max_tokens tokens per request;
* json_schema: the same requests under a JSON schema of an array of objects with at least
  max_tokens items, so that no request can close its array (and end) before max_tokens: both
  configurations compute the same number of tokens per step (tokens are counted, not assumed);
* json_schema+jump: the same on a second engine with jump-forward on (the tokens the grammar
  forces, such as the fixed keys, verified as drafts in one step).

Prefill is taken out by timing a call with max_tokens=T and one with max_tokens=1: decode
tok/s = (tokens of the T call - tokens of the 1 call) / (best t_T - best t_1), each the best of
`--repeats` rounds, rounds interleaved across configurations. Before the table: each schema's
compile time, first and cached (xgrammar's compiler cache).

    python scripts/bench_structured_output.py                       # CPU, the default model
    python scripts/bench_structured_output.py --batch-sizes 1 16 --max-tokens 64 --repeats 3
    python scripts/bench_structured_output.py --device cuda --shape llama-3.1-8b \
        --batch-sizes 1 64 256                          # GPU: a shape, random weights
    python scripts/bench_structured_output.py --device cuda --shape qwen3-0.6b \
        --tokenizer llama-3 --vocab-size 128256 --batch-sizes 1 64 256   # Llama 3's tokens

Without --vocab-size that last one pads Llama 3's 128,256 ids to Qwen3's 151,936: a real Qwen3
pads 267, and xgrammar's accept_token takes about 6 us a token with 23,680 missing ids against
1 us without (this 2-core CPU host; 0.4 ms a step at 64 rows).

A shape's folder holds its benchmark tokenizer (`--tokenizer` picks another, when the shape's
own cannot spell JSON): a grammar needs one. With random weights the schema, not the model,
decides every token's structure; the masks, their application and jump-forward cost the same.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.benchmark.cli import add_llm_args, llm_kwargs, markdown_table, model_folder
from minisgl_backend.benchmark.shapes import SHAPES
from minisgl_backend.benchmark.tokenizer import TOKENIZERS_DIR, WORD_LEVEL, tokenizer_name
from minisgl_backend.tokenizer import encode_chat

SCRIPTS_DIR = Path(__file__).resolve().parent
if str(SCRIPTS_DIR) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DIR))
from bench_offline_cpu import build_script, ensure_model

HEADER = ("batch", "config", "tokens", "decode tok/s", "ms/step", "vs unguided")
CONFIGS = ("unguided", "json_schema", "json_schema+jump")
PEOPLE = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]}},
    "required": ["name", "age", "city"]}}
COMPILED = {  # schemas whose compile time is reported
    "people (array of objects)": PEOPLE,
    "nested object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "tags": {"type": "array",
                                                           "items": {"type": "string"}}},
                 "required": ["id"]}, "active": {"type": "boolean"}},
        "required": ["user", "active"]},
    "string formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}, "required": ["day"]},
}
QUESTIONS = ["List some people as JSON.", "Who lives in Paris?", "Name a few friends.",
             "Describe the team.", "Give me example users.", "Who are the players?"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(build_script().DEFAULT_MODEL_DIR))
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="instead of --model: a model shape with random weights and its "
                   "benchmark tokenizer")
    p.add_argument("--num-layers", type=int, default=None,
                   help="with --shape: override its number of layers")
    p.add_argument("--tokenizer", default=None,
                   choices=sorted(d.name for d in TOKENIZERS_DIR.iterdir() if d.is_dir()),
                   help="with --shape: this committed tokenizer instead of the shape's")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="with --shape: this vocabulary size instead of the shape's, e.g. the "
                   "--tokenizer's own (128256 for llama-3): xgrammar counts the ids a "
                   "tokenizer lacks as special tokens, and its accept_token slows with their "
                   "number")
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="run only these configurations (one alone: a step timeline of it, "
                   "MINISGL_STEP_TIMES_DIR); ratios need unguided")
    add_llm_args(p)
    args = p.parse_args(argv)
    if args.vocab_size is not None and args.shape is None:
        p.error("--vocab-size needs --shape")
    if args.shape is not None and (args.tokenizer or tokenizer_name(args.shape)) == WORD_LEVEL:
        p.error(f"shape {args.shape}'s word-level tokenizer cannot spell JSON: give --tokenizer")
    return args


def compile_times(llm: LLM) -> list[str]:
    lines = []
    for name, schema in COMPILED.items():
        times = []
        for _ in range(2):
            start = time.perf_counter()
            llm.scheduler.grammars.compile(SamplingParams(json_schema=schema))
            times.append(time.perf_counter() - start)
        lines.append(f"compile {name}: first {1e3 * times[0]:.2f} ms, cached "
                     f"{1e3 * times[1]:.3f} ms")
    return lines


def params(config: str, max_tokens: int, min_items: int) -> SamplingParams:
    guide = ({"json_schema": {**PEOPLE, "minItems": min_items}}
             if config.startswith("json_schema") else {})
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **guide)


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The chat prompt of `question`, or its plain tokens where the tokenizer has no chat
    template (a shape's benchmark tokenizer)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": question}])
    return tokenizer.encode(question)


def run(args: argparse.Namespace, model: Path) -> None:
    configs = [c for c in CONFIGS if c in args.configs]
    load_format = "dummy" if args.shape is not None else "auto"
    kwargs = llm_kwargs(args, load_format=load_format)
    jumps = "json_schema+jump" in configs
    with ExitStack() as stack:
        # One engine without jump-forward and one with, each only when a configuration asks
        # for it (an idle engine still holds the GPU).
        by_jump = {jump: stack.enter_context(LLM(str(model), jump_forward=jump, **kwargs))
                   for jump in dict.fromkeys(c.endswith("+jump") for c in configs)}
        engines = {c: by_jump[c.endswith("+jump")] for c in configs}
        llm = next(iter(engines.values()))
        print("\n".join(compile_times(llm)), flush=True)
        prompts = {bs: [prompt_ids(llm.tokenizer, QUESTIONS[i % len(QUESTIONS)])
                        for i in range(bs)] for bs in args.batch_sizes}
        best: dict[tuple[int, str, int], tuple[float, int]] = {}
        for config in configs:  # warm-up
            engines[config].generate(prompts[args.batch_sizes[0]],
                                     params(config, 4, args.max_tokens))
        for round_ in range(args.repeats):
            order = [(bs, c, t) for bs in args.batch_sizes for c in configs
                     for t in (args.max_tokens, 1)]
            for key in (order if round_ % 2 == 0 else order[::-1]):
                bs, config, tokens = key
                start = time.perf_counter()
                outs = engines[config].generate(prompts[bs],
                                                params(config, tokens, args.max_tokens))
                seconds = time.perf_counter() - start
                count = sum(len(o.token_ids) for o in outs)
                if key not in best or seconds < best[key][0]:
                    best[key] = (seconds, count)
        speculator = engines["json_schema+jump"].scheduler.speculator if jumps else None
    rows = []
    for bs in args.batch_sizes:
        base = None
        for config in configs:
            (t_long, n_long), (t_one, n_one) = (best[(bs, config, args.max_tokens)],
                                                best[(bs, config, 1)])
            decode_tokens, decode_s = n_long - n_one, max(t_long - t_one, 1e-9)
            rate = decode_tokens / decode_s
            if config == "unguided":
                base = rate
            steps = max(1, args.max_tokens - 1)
            rows.append([str(bs), config, str(n_long), f"{rate:.1f}",
                         f"{1e3 * decode_s / steps:.2f}",
                         f"{rate / base:.3f}x" if base else "-"])
    name = f"shape {args.shape} (random weights)" if args.shape else model.name
    jumped = (f"; jump-forward: {speculator.accepted} of {speculator.drafted} forced tokens "
              f"kept by {speculator.verified_rows} verifying rows" if speculator else "")
    print(f"model {name}, device {args.device}, max_tokens {args.max_tokens}, best of "
          f"{args.repeats}{jumped}")
    print(markdown_table(HEADER, rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.shape is not None:
        with model_folder(args, tokenizer=True) as (folder, _):
            run(args, folder)
    else:
        run(args, ensure_model(args.model))


if __name__ == "__main__":
    main()
