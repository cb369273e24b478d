"""Offline throughput: a workload through one `LLM.generate` call, prefill included.

    output tok/s = requested output tokens / wall time of that call (after a short warm-up).

Workloads: `anchor` (default), drawn as upstream mini-sglang's benchmark/offline/bench.py draws
it (256 requests, prompt and output lengths uniform in [100, 1024], 142,827 input and 133,966
output tokens, temperature 0.6, ignore_eos); `shared-prefix` (one 2,000-token system prompt
shared by every request, short greedy outputs: the prefix cache's workload); `chat` (chat
prompts of 37-219 tokens with the default model, greedy, `--max-tokens` each).

A shape's folder holds its benchmark tokenizer, so every token is detokenized inside the timed
call, as serving does; `--detokenize off` leaves it out, `both` runs without then with it, and
`replay` runs no engine: the detokenizer alone on random outputs of the workload's lengths.
`--vary` adds runs with engine settings changed (each a fresh engine, compared to the first
run): CUDA graphs (`cuda_graph_max_bs=0`), overlap (`overlap=false`), the prefix cache
(`--workload shared-prefix --vary cache=naive`), KV-cache events (`--page-size 16 --vary
kv_events_endpoint=ipc:///tmp/minisgl-events`: a subscriber drains them during the run).
`--compare-hf` (greedy requests of one length) also runs HF transformers `generate` on the same
prompt ids, batched with left padding and one prompt at a time, and (real weights) counts the
prompts whose greedy tokens equal HF's.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.collector import collector_pauses
from minisgl_backend.benchmark.kv_events import drained_events
from minisgl_backend.benchmark.tokenizer import tokenizer_name
from minisgl_backend.benchmark.workloads import (Workload, anchor_workload, chat_text,
                                                 fixed_workload, random_tokens,
                                                 shared_prefix_workload, text_workload)

if TYPE_CHECKING:
    from minisgl_backend import LLM

HEADER = ("run", "detokenize", "requests", "input tokens", "output tokens", "total s",
          "output tok/s", "prompt cache hits", "vs first")
DETOKENIZE = {"on": (True,), "off": (False,), "both": (False, True)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    cli.add_vary_arg(parser)
    add_workload_args(parser)
    parser.add_argument("--detokenize", choices=(*DETOKENIZE, "replay"), default="on")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also HF transformers generate, batched and one prompt at a time")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The options of `make_workload`."""
    parser.add_argument("--workload", choices=("anchor", "shared-prefix", "chat"),
                        default="anchor")
    parser.add_argument("--num-requests", type=int, help="default: 256 anchor, 64 shared-prefix, "
                        "16 chat")
    parser.add_argument("--min-len", type=int, default=100, help="anchor: input and output")
    parser.add_argument("--max-len", type=int, default=1024, help="anchor: input and output")
    parser.add_argument("--temperature", type=float, default=0.6, help="anchor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix")
    parser.add_argument("--suffix-len", type=int, default=32, help="shared-prefix")
    parser.add_argument("--max-tokens", type=int, help="shared-prefix (16), chat (64)")


def make_workload(args: argparse.Namespace, folder: Path, vocab: int) -> Workload:
    """The --workload's requests (chat: through the folder's tokenizer)."""
    if args.workload == "anchor":
        return anchor_workload(vocab, args.num_requests or 256, args.min_len, args.max_len,
                               args.seed, args.temperature)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(vocab, args.num_requests or 64, args.prefix_len,
                                      args.suffix_len, args.max_tokens or 16, args.seed)
    from transformers import AutoTokenizer

    texts = [chat_text(i) for i in range(args.num_requests or 16)]
    return text_workload(AutoTokenizer.from_pretrained(str(folder)), texts,
                         args.max_tokens or 64)


def timed_generate(args: argparse.Namespace, folder: Path, workload: Workload, vocab: int,
                   overrides: dict[str, Any]) -> tuple[float, list[Any], str]:
    """`time_workload` on a fresh engine (its KV-cache events drained, if it publishes any)."""
    endpoint = cli.llm_kwargs(args, **overrides).get("kv_events_endpoint")
    with cli.make_llm(args, folder, **overrides) as llm:
        if not endpoint:
            return time_workload(llm, workload, vocab, args.seed)
        with drained_events(endpoint) as counts:
            seconds, outputs, pauses = time_workload(llm, workload, vocab, args.seed)
    return seconds, outputs, f"{pauses}; KV-cache events drained: {counts[0]} messages, " \
        f"{counts[1]} bytes; the publisher thread's CPU: {counts[2]:.2f} s"


def time_workload(llm: LLM, workload: Workload, vocab: int,
                  seed: int) -> tuple[float, list[Any], str]:
    """A warm-up, then one timed `generate` of `workload`: (seconds, outputs, the garbage
    collector's pauses in this process during that call)."""
    warmup = fixed_workload(vocab, 8, 32, 8, seed=seed + 1)
    llm.generate(warmup.prompts, warmup.params)
    with collector_pauses() as pauses:
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, workload.params)
        seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    if generated != workload.output_tokens:
        raise RuntimeError(f"generated {generated} tokens, requested {workload.output_tokens}")
    return seconds, outputs, pauses.describe()


def hf_runs(args: argparse.Namespace, folder: Path, config: dict[str, Any], workload: Workload
            ) -> list[tuple[str, float, list[list[int]]]]:
    """HF transformers greedy `generate` of the workload, batched (left-padded) and one prompt
    at a time, after a warm-up: (name, seconds, new tokens per prompt). EOS neither stops nor
    is masked, as with ignore_eos."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype = cli.torch_device(args), cli.engine_dtype(args, config)
    torch.set_num_threads(os.cpu_count() or 1)  # the engine has shut down: every core is free
    with torch.device(device):  # a shape's random weights are made on the device: fast
        model = (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
                 if args.shape else AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype))
    model.eval()
    pad = model.generation_config.pad_token_id or 0
    model.generation_config.eos_token_id = None
    max_tokens = workload.params[0].max_tokens

    def generate(prompts: list[list[int]], tokens: int = max_tokens) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad)
        return out[:, width:].tolist()

    generate([workload.prompts[0][:8]], 4)
    runs = []
    for name, run in (("HF batched (left pad)", lambda: generate(workload.prompts)),
                      ("HF one prompt at a time", lambda: [generate([p])[0]
                                                            for p in workload.prompts])):
        start = time.perf_counter()
        tokens = run()
        runs.append((name, time.perf_counter() - start, tokens))
    return runs


def replay(args: argparse.Namespace) -> None:
    """The detokenizer alone, as the scheduler runs it for a stream (one `IncrementalDetokenizer`
    per request, given its prompt), on random outputs of the workload's lengths."""
    from transformers import AutoTokenizer

    from minisgl_backend.tokenizer import IncrementalDetokenizer

    with cli.model_folder(args) as (folder, config):
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        workload = make_workload(args, folder, config["vocab_size"])
    rng = random.Random(args.seed + 2)
    start = time.perf_counter()
    for prompt, params in zip(workload.prompts, workload.params):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        for token in random_tokens(rng, config["vocab_size"], params.max_tokens):
            detokenizer.push([token])
        detokenizer.flush()
    seconds, tokens = time.perf_counter() - start, workload.output_tokens
    cli.print_header(args, "the detokenizer alone, no engine", config)
    name = (args.tokenizer or tokenizer_name(args.shape)) if args.shape else "the model's"
    print(f"tokenizer {name!r}, random outputs of the {args.workload} "
          f"workload ({len(workload)} requests, {tokens} tokens): {seconds:.3f} s, "
          f"{1e6 * seconds / tokens:.2f} us per token")


def run(args: argparse.Namespace) -> None:
    if args.detokenize == "replay":
        replay(args)
        return
    if args.shape is None and args.detokenize != "on":
        raise SystemExit("--detokenize off and both need --shape (a model folder's tokenizer)")
    results, notes = [], []
    if args.shape is not None and args.detokenize != "off":
        notes.append(f"detokenize on: tokenizer {args.tokenizer or tokenizer_name(args.shape)!r}")
    for detokenize in DETOKENIZE[args.detokenize]:
        with cli.model_folder(args, tokenizer=detokenize) as (folder, config):
            vocab = config["vocab_size"]
            workload = make_workload(args, folder, vocab)
            if args.compare_hf and (len({p.max_tokens for p in workload.params}) != 1 or any(
                    p.temperature > 0 for p in workload.params)):
                raise SystemExit("--compare-hf needs greedy requests of one length "
                                 "(--workload chat)")
            on = "on" if detokenize else "off"
            for label, overrides in cli.variants(args):
                seconds, outputs, pauses = timed_generate(args, folder, workload, vocab,
                                                          overrides)
                print(f"{label}, detokenize {on}: {seconds:.3f} s", flush=True)
                notes.append(f"garbage collector, {label}, detokenize {on} (this process, in the "
                             f"timed call): {pauses}")
                hits = sum(o.cached_tokens for o in outputs) / workload.input_tokens
                results.append((label, on, seconds, [o.token_ids for o in outputs],
                                f"{hits:.1%}"))
            if args.compare_hf:
                results += [(name, "-", s, tokens, "-")
                            for name, s, tokens in hf_runs(args, folder, config, workload)]
    first = results[0]
    if args.compare_hf and args.shape is None:  # random weights: the engine's and HF's differ
        same = sum(a == b for a, b in zip(first[3], results[-1][3]))
        notes.append(f"greedy tokens: {same}/{len(workload)} prompts identical to HF's "
                     f"(one prompt at a time)")
    rows = [[label, detok, str(len(workload)), str(workload.input_tokens),
             str(sum(map(len, tokens))), f"{s:.3f}", f"{sum(map(len, tokens)) / s:.1f}", hits,
             f"{first[2] / s:.2f}x"] for label, detok, s, tokens, hits in results]
    cli.report(args, f"{args.workload} workload through one LLM.generate call, each run against "
               f"the first (same requests; fresh engine each)", HEADER, rows, config, notes)
