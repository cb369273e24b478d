"""Speculative decoding on CPU with the default model: off, `ngram` and `suffix` side by side.

Two workloads of chat prompts, greedy, up to `--max-tokens` each (outputs are identical across
the configurations, so each generates the same tokens):

* repetitive: "repeat / rewrite this passage" requests over short passages, whose outputs copy
  their input (where draft-free speculation should win);
* chat: free-form questions (where drafts are rarely right and speculation must not cost).

One engine per configuration, all alive at once, calls interleaved over `--repeats` rounds,
each round with other prompts (the `suffix` history would otherwise hold the very outputs of
the round before). Prefill is taken out as in the other benchmarks: decode tok/s = (tokens of
the max_tokens calls - tokens of max_tokens=1 calls) / (their time difference), summed over the
rounds; acceptance = kept / verified draft tokens.

    python scripts/bench_speculative_cpu.py                      # batch 1 and 8
    python scripts/bench_speculative_cpu.py --batch-sizes 1 --max-tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.benchmark.cli import markdown_table
from minisgl_backend.tokenizer import encode_chat

SCRIPTS_DIR = Path(__file__).resolve().parent
if str(SCRIPTS_DIR) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DIR))
from bench_offline_cpu import build_script, ensure_model  # noqa: E402

HEADER = ("workload", "batch", "config", "tokens", "decode tok/s", "vs off", "acceptance")
PASSAGES = [
    "The quick brown fox jumps over the lazy dog. The dog did not move, because it was "
    "sleeping in the warm afternoon sun next to the old red barn on the hill.",
    "def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    return a * b\n",
    "Our meeting is moved to Thursday at 3 pm in room 204. Please bring the quarterly report "
    "and the budget draft, and send your slides to Maria before noon.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, mostly in the leaves.",
]
ASKS = ["Repeat this text exactly, word for word:\n\n", "Rewrite this text without changes:\n\n"]
QUESTIONS = ["What is a good name for a cat?", "Tell me a fun fact about space.",
             "How do I make a cup of tea?", "Why is the sky blue?", "Write a haiku about rain.",
             "What should I pack for a trip?", "Give me three tips for sleeping well.",
             "What is the capital of Italy and why is it famous?", "How do bees make honey?",
             "Suggest a name for a bakery.", "What is a black hole?", "How do I tie a tie?",
             "Why do leaves change colour?", "Describe a sunset in two sentences.",
             "What are the planets of the solar system?", "How does a bicycle stay upright?",
             "Give me a recipe idea with eggs.", "What is the tallest mountain?",
             "Why do we dream?", "Write a limerick about a dog.", "How do vaccines work?",
             "What is the speed of light?", "Name three famous painters.",
             "How can I learn to draw?"]
CONFIGS = {"off": {}, "ngram": {"speculative": "ngram"}, "suffix": {"speculative": "suffix"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(build_script().DEFAULT_MODEL_DIR))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def workloads(tokenizer: object, batch: int, round_: int) -> dict[str, list[list[int]]]:
    """Round `round_`'s prompts (each round its own, as far as the lists go)."""
    def chat(text: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])

    first = round_ * batch
    return {
        "repetitive": [chat(ASKS[i // len(PASSAGES) % 2] + PASSAGES[i % len(PASSAGES)])
                       for i in range(first, first + batch)],
        "chat": [chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(first, first + batch)],
    }


def run(args: argparse.Namespace) -> None:
    model = ensure_model(args.model)
    engines = {name: LLM(model, device="cpu", **settings) for name, settings in CONFIGS.items()}
    try:
        tokenizer = engines["off"].tokenizer
        totals: dict[tuple[str, int, str], list[float]] = {}  # seconds, tokens, drafted, kept
        for bs in args.batch_sizes:
            for name, llm in engines.items():  # warm-up
                llm.generate(workloads(tokenizer, 1, 0)["chat"], SamplingParams(max_tokens=2))
            for round_ in range(args.repeats):
                for workload, prompts in workloads(tokenizer, bs, round_).items():
                    order = list(engines.items())
                    for name, llm in (order if round_ % 2 == 0 else order[::-1]):
                        spec = llm.scheduler.speculator
                        total = totals.setdefault((workload, bs, name), [0.0, 0, 0, 0])
                        for tokens, sign in ((args.max_tokens, 1), (1, -1)):
                            before = (spec.drafted, spec.accepted)
                            start = time.perf_counter()
                            outs = llm.generate(prompts, SamplingParams(max_tokens=tokens))
                            total[0] += sign * (time.perf_counter() - start)
                            total[1] += sign * sum(len(o.token_ids) for o in outs)
                            total[2] += spec.drafted - before[0]
                            total[3] += spec.accepted - before[1]
    finally:
        for llm in engines.values():
            llm.shutdown()
    rows = []
    for bs in args.batch_sizes:
        for workload in ("repetitive", "chat"):
            base = None
            for name in CONFIGS:
                seconds, tokens, drafted, kept = totals[(workload, bs, name)]
                rate = tokens / seconds
                base = rate if base is None else base
                rows.append([workload, str(bs), name, str(tokens), f"{rate:.1f}",
                             f"{rate / base:.2f}x", f"{kept / drafted:.2f}" if drafted else "-"])
    print(f"model {model.name}, cpu, greedy, max_tokens {args.max_tokens}, {args.repeats} "
          f"rounds")
    print(markdown_table(HEADER, rows))


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
