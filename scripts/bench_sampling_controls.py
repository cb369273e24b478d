"""Decode throughput with and without the per-request sampling controls, side by side.

One `LLM` (one engine) serves every configuration, so they share the process, the weights and
the caches. Per batch size B the configurations are:

* none: plain sampling (temperature 0.7, a seed per request);
* all: the same with every control on: repetition_penalty 1.1, presence_penalty 0.3,
  frequency_penalty 0.2, min_p 0.05, a logit_bias of 50 entries, bad_token_ids of 3 single
  tokens and 3 sequences of 2-3 tokens, logprobs 5;
* with `--each`, also every control alone on top of none.

Each call generates for B prompts of `--prompt-len` random tokens (fresh ones every call: no
prefix-cache hits) with `ignore_eos`, so every request makes exactly its max_tokens. Prefill is
taken out by timing a call with max_tokens=T and one with max_tokens=1 (prefill + the first
token): the difference covers T-1 decode steps, so

    decode tok/s = B * (T - 1) / (best t_T - best t_1),   ms/step = the difference / (T - 1),

each time the best over `--repeats` rounds. A warm-up call of every configuration comes first
(it also allocates the controls' device state, which an engine does on first use). The rounds
are interleaved to cancel drift: each round times every batch size and configuration, in
forward order on even rounds and reversed on odd ones. `vs none` is the configuration's decode
throughput over none's at the same batch size. On Linux the cores that other processes kept busy
during the best calls are printed too (a loaded machine skews any figure). The prefix cache is
the naive one by default (`--cache`): random prompts never share a prefix, and a radix cache
filled by the earlier calls would make the later ones pay for its eviction.

Before the table: the device state the controls allocate per engine table row, for 256 rows
and a vocabulary of 152,064 (Qwen2.5's) and for the engine at hand. It is measured on a small
`LogitControls` on the CPU before any timing, so it follows the dtypes in engine/controls.py.

    python scripts/bench_sampling_controls.py                    # CPU, the default model
    python scripts/bench_sampling_controls.py --each --repeats 5
    python scripts/bench_sampling_controls.py --device cuda --shape qwen3-0.6b \
        --load-format dummy --batch-sizes 1 64 256                # GPU, a real shape
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import random
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl_backend.benchmark.cli import (
    add_llm_args,
    device_name,
    human_bytes,
    llm_kwargs,
    markdown_table,
    model_folder,
    torch_device,
)
from minisgl_backend.benchmark.shapes import SHAPES, describe
from minisgl_backend.benchmark.workloads import random_tokens
from minisgl_backend.core import MAX_LOGIT_BIAS, SamplingParams
from minisgl_backend.engine.config import resolve_dtype
from minisgl_backend.models import ModelConfig

SCRIPTS_DIR = Path(__file__).resolve().parent
if str(SCRIPTS_DIR) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DIR))
from bench_offline_cpu import Call, build_script, ensure_model, timed_call  # noqa: E402

HEADER = ("batch", "config", "decode tok/s", "ms/step", "vs none")
TEMPERATURE = 0.7
BIAS_ENTRIES = 50
MEMORY_ROWS, MEMORY_VOCAB = 256, 152_064


def controls(vocab: int) -> dict[str, dict[str, Any]]:
    """Each control's settings (token ids drawn once from a fixed seed within `vocab`)."""
    rng = random.Random(0)
    ids = rng.sample(range(vocab), BIAS_ENTRIES + 12)
    bias = {t: round(rng.uniform(-2.0, 2.0), 3) for t in ids[:BIAS_ENTRIES]}
    rest = ids[BIAS_ENTRIES:]
    bans = [[rest[0]], [rest[1]], [rest[2]], rest[3:5], rest[5:7], rest[7:10]]
    return {
        "repetition_penalty": {"repetition_penalty": 1.1},
        "presence_penalty": {"presence_penalty": 0.3},
        "frequency_penalty": {"frequency_penalty": 0.2},
        "min_p": {"min_p": 0.05},
        "logit_bias": {"logit_bias": bias},
        "bad_token_ids": {"bad_token_ids": bans},
        "logprobs": {"logprobs": 5},
    }


def configurations(vocab: int, each: bool) -> dict[str, dict[str, Any]]:
    """Name -> the SamplingParams fields beside max_tokens, temperature, seed and ignore_eos."""
    per_control = controls(vocab)
    configs: dict[str, dict[str, Any]] = {"none": {}}
    configs["all"] = {k: v for settings in per_control.values() for k, v in settings.items()}
    if each:
        configs.update(per_control)
    return configs


# ----- the controls' device state ----------------------------------------------------------------


def state_bytes_per_row(vocab: int, settings: dict[str, Any]) -> dict[str, int]:
    """Bytes per table row of each device tensor the controls allocate for a request with
    `settings`: one is admitted to a 2-row `LogitControls` on the CPU, as the engine does."""
    from minisgl_backend.engine.controls import LogitControls, RowParams
    from minisgl_backend.engine.protocol import StepMessage

    rows, p = 2, SamplingParams(**settings)
    row_params = RowParams(rows)
    state = LogitControls(row_params, rows, vocab, torch.zeros((rows, 8), dtype=torch.int32))
    msg = StepMessage(is_prefill=True, rows=[0], admit_rows=[0])
    msg.admit = {name: [value] for name, value in p.row_values(0).items()}
    msg.prompt_rows, msg.prompt_counts, msg.prompt_tokens = [0], [1], [0]
    bias = p.logit_bias or {}
    msg.bias_rows, msg.bias_counts = [0], [len(bias)]
    msg.bias_ids, msg.bias_values = list(bias), list(bias.values())
    for seq in p.bad_token_ids:
        msg.ban_rows.append(0)
        msg.ban_lens.append(len(seq))
        msg.ban_tokens.extend(seq)
    msg = StepMessage.from_bytes(msg.to_bytes())  # numpy arrays, as the engine gets them
    row_params.admit(np.asarray(msg.admit_rows, dtype=np.int64), msg.admit)
    state.admit(msg)
    tensors = {"counts": state.counts, "in_prompt": state.in_prompt, "bias_ids": state.bias_ids,
               "bias_values": state.bias_values, "ban_tokens": state.ban_tokens}
    missing = [name for name, t in tensors.items() if t is None]
    if missing:
        raise RuntimeError(f"the probe request allocated no {', '.join(missing)}")
    return {name: t.nbytes // rows for name, t in tensors.items()}


def memory_report(vocab: int, engine_rows: int) -> list[str]:
    """The controls' device state per row with the "all" settings, as lines to print."""
    settings = configurations(MEMORY_VOCAB, each=False)["all"]
    per_row = state_bytes_per_row(MEMORY_VOCAB, settings)
    width, seqs = _pow2(BIAS_ENTRIES), settings["bad_token_ids"]
    slots, length = _pow2(len(seqs)), _pow2(max(len(s) for s in seqs))
    size = {"counts": per_row["counts"] // MEMORY_VOCAB,
            "in_prompt": per_row["in_prompt"] // MEMORY_VOCAB,
            "bias_ids": per_row["bias_ids"] // width,
            "bias_values": per_row["bias_values"] // width,
            "ban_tokens": per_row["ban_tokens"] // (slots * length)}
    per_token = size["counts"] + size["in_prompt"]
    per_entry = size["bias_ids"] + size["bias_values"]
    penalty, bias = MEMORY_VOCAB * per_token, width * per_entry
    bias_max, bans = _pow2(MAX_LOGIT_BIAS) * per_entry, per_row["ban_tokens"]
    rows = MEMORY_ROWS
    return [
        "## Device state of the sampling controls (allocated on first use, for every table row: "
        "max_running_requests + 1)",
        f"per row = V x ({size['counts']} B counts + {size['in_prompt']} B in_prompt) "
        f"[penalties] + W x ({size['bias_ids']} B id + {size['bias_values']} B value) "
        f"[logit_bias] + S x L x {size['ban_tokens']} B [bad_token_ids]; V: the vocabulary; W: "
        f"the most logit_bias entries of a request, S and L: the most sequences of a request "
        f"and the longest one, each rounded up to a power of 2 (the tables only widen)",
        f"at {rows} rows and V = {MEMORY_VOCAB:,}: penalties {penalty:,} B/row = "
        f"{human_bytes(rows * penalty)}; logit_bias of {BIAS_ENTRIES} entries (W = {width}) "
        f"{bias:,} B/row = {human_bytes(rows * bias)}, of {MAX_LOGIT_BIAS} (the most allowed) "
        f"{bias_max:,} B/row = {human_bytes(rows * bias_max)}; bad_token_ids as benchmarked "
        f"(S = {slots}, L = {length}) {bans:,} B/row = {human_bytes(rows * bans)}; everything "
        f"as benchmarked {human_bytes(rows * (penalty + bias + bans))}",
        f"this engine ({engine_rows} rows, V = {vocab:,}): penalties "
        f"{human_bytes(engine_rows * vocab * per_token)}; everything as benchmarked "
        f"{human_bytes(engine_rows * (vocab * per_token + bias + bans))}",
    ]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----- timing -----------------------------------------------------------------------------------


@dataclass
class Timings:
    """The timed calls of one (batch size, configuration): max_tokens 1 and T."""

    first: list[Call] = field(default_factory=list)
    full: list[Call] = field(default_factory=list)

    def decode_seconds(self) -> float:
        return min(c.seconds for c in self.full) - min(c.seconds for c in self.first)

    def other_cores(self) -> float | None:
        """The most cores other processes kept busy during the two best calls."""
        best = [min(calls, key=lambda c: c.seconds) for calls in (self.first, self.full)]
        values = [c.other_cores for c in best]
        return None if any(v is None for v in values) else max(values)


class Runner:
    """Calls of one engine, each on fresh prompts."""

    def __init__(self, llm: Any, vocab: int, prompt_len: int) -> None:
        self.llm, self.vocab, self.prompt_len = llm, vocab, prompt_len
        self.rng = random.Random(1234)

    def call(self, batch: int, max_tokens: int, settings: dict[str, Any]) -> Call:
        prompts = [random_tokens(self.rng, self.vocab, self.prompt_len) for _ in range(batch)]
        params = [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, seed=i,
                                 ignore_eos=True, **settings) for i in range(batch)]

        def run() -> list[list[int]]:
            outs = self.llm.generate(prompts, params)
            for out in outs:
                if len(out.token_ids) != max_tokens:
                    raise RuntimeError(f"a request made {len(out.token_ids)} tokens, not "
                                       f"{max_tokens}")
                lp = settings.get("logprobs")
                if lp is not None and (len(out.logprobs or ()) != max_tokens
                                       or any(len(t) != lp for t in out.top_logprobs)):
                    raise RuntimeError("log-probabilities missing")
            return [o.token_ids for o in outs]

        return timed_call(run)


def bench(args: argparse.Namespace, folder: Path, vocab: int,
          configs: dict[str, dict[str, Any]]) -> dict[tuple[int, str], Timings]:
    from minisgl_backend import LLM

    kwargs = llm_kwargs(args, load_format=args.load_format, cache=args.cache)
    kwargs["max_running_requests"] = max(kwargs.get("max_running_requests", 0),
                                         *args.batch_sizes)
    results = {(bs, name): Timings() for bs in args.batch_sizes for name in configs}
    with LLM(folder, **kwargs) as llm:
        runner = Runner(llm, vocab, args.prompt_len)
        for bs in args.batch_sizes:  # warm-up: every code path, the controls' device state
            for settings in configs.values():
                runner.call(bs, 2, settings)
        print(f"warmed up; {args.repeats} rounds of {len(args.batch_sizes)} batch sizes x "
              f"{len(configs)} configurations", flush=True)
        for r in range(args.repeats):
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            for bs in args.batch_sizes:
                for name in names:
                    timing = results[bs, name]
                    timing.first.append(runner.call(bs, 1, configs[name]))
                    timing.full.append(runner.call(bs, args.max_tokens, configs[name]))
            print(f"round {r + 1} done", flush=True)
    return results


# ----- report -----------------------------------------------------------------------------------


def table_rows(args: argparse.Namespace, configs: dict[str, dict[str, Any]],
               results: dict[tuple[int, str], Timings]) -> list[list[str]]:
    steps = args.max_tokens - 1
    rows = []
    for bs in args.batch_sizes:
        base = (bs * steps / results[bs, "none"].decode_seconds()
                if (bs, "none") in results else None)
        for name in configs:
            seconds = results[bs, name].decode_seconds()
            if seconds <= 0:
                raise RuntimeError(f"batch {bs} {name}: decode time <= 0 (noise); use more "
                                   f"--max-tokens")
            tps = bs * steps / seconds
            rows.append([str(bs), name, f"{tps:.1f}", f"{1e3 * seconds / steps:.3f}",
                         f"{tps / base:.2f}x" if base else "-"])
    return rows


def print_calls(args: argparse.Namespace, configs: dict[str, dict[str, Any]],
                results: dict[tuple[int, str], Timings]) -> None:
    def fmt(calls: list[Call]) -> str:
        return ", ".join(f"{c.seconds:.3f}" for c in calls)

    for bs in args.batch_sizes:
        for name in configs:
            t = results[bs, name]
            other = t.other_cores()
            busy = "" if other is None else (f"; during the best two, other processes kept "
                                             f"up to {other:.2f} cores busy")
            print(f"batch {bs} {name}: t_{args.max_tokens} [{fmt(t.full)}] s, t_1 "
                  f"[{fmt(t.first)}] s{busy}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(build_script().DEFAULT_MODEL_DIR),
                        help="HF model folder (default: the default model, built if missing)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="instead of --model: a model shape with random weights from its "
                        "config.json alone (implies --load-format dummy)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="with --shape: override its number of layers")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: random weights (the folder's config.json only)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto",
                        help="auto (float32 on CPU, the checkpoint's half type on GPU), ...")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64, help="T, for every batch size")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best is kept")
    parser.add_argument("--each", action="store_true", help="also every control alone")
    parser.add_argument("--configs", nargs="+", default=None,
                        choices=list(configurations(1000, each=True)),
                        help="only these configurations (none, all or a control), e.g. one "
                        "per run for a step timeline (MINISGL_STEP_TIMES_DIR) of each")
    parser.add_argument("--cache", default="naive", choices=("naive", "radix"),
                        help="prefix cache (default naive: the random prompts never share one)")
    add_llm_args(parser)
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (one decode step at least)")
    if args.repeats < 1 or args.prompt_len < 1 or min(args.batch_sizes) < 1:
        parser.error("--repeats, --prompt-len and --batch-sizes must be >= 1")
    if args.shape is not None:
        args.load_format = "dummy"
    return args


def run(args: argparse.Namespace, folder: Path) -> None:
    config = ModelConfig.from_folder(folder)
    vocab = config.vocab_size
    configs = configurations(vocab, args.each or args.configs is not None)
    if args.configs is not None:
        configs = {name: configs[name] for name in args.configs}
    max_running = max(args.max_running_requests or _llm_default("max_running_requests"),
                      *args.batch_sizes)
    memory = memory_report(vocab, max_running + 1)  # before the timing: it fails early
    dtype = resolve_dtype(args.dtype, torch_device(args).type, config.torch_dtype)
    results = bench(args, folder, vocab, configs)
    print()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"device: {device_name(args)}; torch {torch.__version__}")
    weights = "random weights" if args.load_format == "dummy" else "its weights"
    raw = json.loads((folder / "config.json").read_text())
    model = args.shape or str(args.model)
    print(f"model: {model} ({describe(raw)}), {dtype}, {weights}")
    print(f"prompts of {args.prompt_len} random tokens; decode = best t(max_tokens="
          f"{args.max_tokens}) - best t(max_tokens=1) = {args.max_tokens - 1} steps; "
          f"{args.repeats} interleaved rounds; temperature {TEMPERATURE}; LLM settings "
          f"{_settings(args)}")
    if "all" in configs:
        print(f"all = {configs['all']}")
    print_calls(args, configs, results)
    print()
    print("\n".join(memory))
    print()
    print(markdown_table(HEADER, table_rows(args, configs, results)))


def _llm_default(name: str) -> Any:
    from minisgl_backend import LLM

    return inspect.signature(LLM).parameters[name].default


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in llm_kwargs(args, load_format=args.load_format,
                                        cache=args.cache).items()
            if k not in ("device", "dtype")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.shape is not None:
        with model_folder(args) as (folder, _):
            run(args, folder)
    else:
        run(args, ensure_model(args.model))


if __name__ == "__main__":
    main()
