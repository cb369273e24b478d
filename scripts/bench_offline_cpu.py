"""Offline CPU throughput: minisgl_backend's `LLM.generate` next to HF transformers `generate`.

Three systems run the same model (default: SmolLM2-135M-Instruct) in float32 on CPU, in one run,
on the same token ids: 16 deterministic chat-templated prompts of varied lengths (37 to 219
tokens with the default model), tokenized once, each generating exactly 64 new tokens greedily.

* minisgl: `LLM(model, device="cpu", dtype="float32")`, one short warm-up `generate`, then one
  timed `generate` of all prompts. Its engine runs in a separate process that uses all cores
  (`torch.set_num_threads(os.cpu_count())` there). The `LLM` start-up (engine process spawn and
  model load) is reported but excluded from throughput. Each repeat starts a fresh `LLM`, so a
  timed call never reuses the prefix cache of an earlier timed call (only the shared chat-template
  prefix within a call, and the warm-up prompt, can hit the radix cache).
* HF batched: one `model.generate` call on all prompts, left-padded with an attention mask.
* HF sequential: one `model.generate` call per prompt (batch size 1, no padding).

HF runs in this process with `torch.set_num_threads(os.cpu_count())`, after the minisgl engine
has shut down, so the two never compete for cores. HF also gets one short warm-up call. Each
timed call is wall time; output tok/s is `num_prompts * max_tokens / time`; `--repeat N` keeps the
best of N calls. On Linux the cores busy in this process tree and in other processes during the
best call are printed too: other processes on a small machine (and the OpenMP spin-waits they
provoke) can slow any of the systems several times over.

Fixed-length decoding: minisgl uses `ignore_eos=True` (EOS does not stop a request and is not
masked). HF gets `min_new_tokens = max_new_tokens`, and its generation config has no EOS id so
that it neither stops nor masks EOS; both systems then follow the same greedy argmax. The greedy
tokens of minisgl are compared with HF sequential (HF batched with padding may legitimately
differ slightly through float rounding).

Usage::

    python scripts/bench_offline_cpu.py [--num-prompts 16] [--max-tokens 64] [--repeat 1]
        [--page-size N] [--chunked-prefill-size N] [--max-total-tokens N] [--cache radix|naive]
        [--skip-hf-sequential] [--model DIR]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SCRIPTS_DIR = Path(__file__).resolve().parent

QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Give three tips for better sleep.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Describe how a bicycle works.",
    "What are prime numbers? Give examples.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly robot and explain it.",
    "What is the difference between weather and climate?",
    "Explain what a hash table is.",
    "Write a haiku about autumn leaves.",
    "List some healthy breakfast ideas.",
)
CONTEXT_SENTENCES = (
    "The library opens at nine in the morning and closes at six in the evening.",
    "Many students prefer to study in the quiet reading room on the second floor.",
    "Last year the city planted more than two thousand trees along its main avenues.",
    "A small bakery near the station sells fresh bread and pastries every day.",
    "The museum recently added a new wing dedicated to ancient maritime history.",
    "Volunteers meet every Saturday to clean the beach and sort recyclable waste.",
    "The river that crosses the town used to power several old flour mills.",
    "Local farmers bring vegetables, cheese and honey to the market on Sundays.",
    "An old lighthouse stands on the rocky cape at the northern end of the bay.",
    "The school choir won a regional competition with a medley of folk songs.",
    "Cyclists can follow a marked trail that runs along the canal for forty kilometres.",
    "In winter the lake sometimes freezes thick enough for people to skate on it.",
)
# Context sentences per prompt: spreads prompt lengths from ~40 to ~220 tokens.
CONTEXT_COUNTS = (0, 11, 2, 7, 0, 5, 9, 1, 12, 3, 6, 0, 10, 4, 8, 12)
WARMUP_PROMPT_TOKENS = 8
WARMUP_NEW_TOKENS = 4

Outputs = list[list[int]]


@dataclass
class Call:
    """One timed call: wall seconds, generated tokens, and average busy cores during it in this
    process tree (this process and its children, e.g. the engine) and in all other processes."""

    seconds: float
    outputs: Outputs
    own_cores: float | None
    other_cores: float | None


@dataclass
class Timing:
    """A system's timed calls; `best` is the fastest, `outputs` those of the first call."""

    name: str
    calls: list[Call]
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Call:
        return min(self.calls, key=lambda c: c.seconds)

    @property
    def seconds(self) -> float:
        return self.best.seconds

    @property
    def outputs(self) -> Outputs:
        return self.calls[0].outputs


# ----- CPU accounting (Linux /proc; None elsewhere) --------------------------------------------


@dataclass
class CpuSample:
    """Busy CPU seconds of the whole machine and of this process tree, at one instant."""

    wall: float
    system_busy: float | None
    tree_busy: float | None

    @classmethod
    def now(cls) -> CpuSample:
        return cls(time.perf_counter(), _system_busy_seconds(), _tree_busy_seconds(os.getpid()))


def _system_busy_seconds() -> float | None:
    """Non-idle CPU seconds of all cores since boot, from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, from /proc/PID/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # the fields after "pid (comm)"
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _tree_busy_seconds(root: int) -> float | None:
    """CPU seconds used so far by `root` and its live descendants."""
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return None
    stats = {int(pid): st for pid in pids if (st := _proc_stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats[pid][1] if pid in stats else 0.0
        todo.extend(children.get(pid, []))
    return total


def timed_call(fn: Callable[[], Outputs]) -> Call:
    """Run `fn` once: its wall time, outputs and the busy cores (own / others) meanwhile."""
    before = CpuSample.now()
    outputs = fn()
    after = CpuSample.now()
    wall = after.wall - before.wall
    if before.system_busy is None or before.tree_busy is None \
            or after.system_busy is None or after.tree_busy is None:
        return Call(wall, outputs, None, None)
    own = (after.tree_busy - before.tree_busy) / wall
    system = (after.system_busy - before.system_busy) / wall
    return Call(wall, outputs, own, max(0.0, system - own))


# ----- setup -----------------------------------------------------------------------------------


def build_script() -> ModuleType:
    """scripts/build_default_model.py (DEFAULT_MODEL_DIR, build_default_model)."""
    if str(SCRIPTS_DIR) not in sys.path:
        sys.path.insert(0, str(SCRIPTS_DIR))
    return importlib.import_module("build_default_model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(build_script().DEFAULT_MODEL_DIR),
                   help="HF model folder (default: the default model, built if missing)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (fixed)")
    p.add_argument("--repeat", type=int, default=1, help="timed calls per system; best is kept")
    p.add_argument("--page-size", type=int, default=None, help="minisgl page_size")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="minisgl chunked_prefill_size")
    p.add_argument("--max-total-tokens", type=int, default=None, help="minisgl KV pool tokens")
    p.add_argument("--cache", choices=("radix", "naive"), default=None, help="minisgl cache")
    p.add_argument("--skip-hf-sequential", action="store_true",
                   help="skip the one-prompt-at-a-time HF baseline")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def ensure_model(model: str) -> Path:
    """The model folder; the default one is built first if missing."""
    path, script = Path(model), build_script()
    if path.resolve() == script.DEFAULT_MODEL_DIR.resolve() \
            and not (path / "config.json").is_file():
        print(f"building the default model into {path} ...", flush=True)
        script.build_default_model(path)
    return path


def make_prompts(tokenizer: Any, count: int) -> Outputs:
    """`count` chat-templated prompts as token ids (deterministic, varied lengths)."""
    prompts = []
    for i in range(count):
        n_ctx = CONTEXT_COUNTS[i % len(CONTEXT_COUNTS)]
        ctx = " ".join(CONTEXT_SENTENCES[(i + j) % len(CONTEXT_SENTENCES)] for j in range(n_ctx))
        question = QUESTIONS[i % len(QUESTIONS)]
        content = f"Background: {ctx}\n\nQuestion: {question}" if ctx else question
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def check_lengths(timing: Timing, max_tokens: int) -> None:
    for k, call in enumerate(timing.calls):
        bad = [i for i, o in enumerate(call.outputs) if len(o) != max_tokens]
        if bad:
            raise RuntimeError(f"{timing.name} call {k}: prompts {bad} did not generate exactly "
                               f"{max_tokens} tokens")


# ----- minisgl ---------------------------------------------------------------------------------


def minisgl_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"device": "cpu", "dtype": "float32"}
    for name in ("page_size", "chunked_prefill_size", "max_total_tokens", "cache"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def timed_generate(llm: Any, prompts: Outputs, params: Any) -> tuple[Call, int]:
    """One timed `llm.generate` of all prompts, and its prefix-cache hit prompt tokens."""
    outs: list[Any] = []

    def run() -> Outputs:
        outs.extend(llm.generate(prompts, params))
        return [list(o.token_ids) for o in outs]

    call = timed_call(run)
    return call, sum(o.cached_tokens for o in outs)


def bench_minisgl(model: Path, prompts: Outputs, args: argparse.Namespace) -> Timing:
    """`--repeat` rounds of: start a fresh LLM, warm up, time one `generate` of all prompts."""
    from minisgl_backend import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    warmup = SamplingParams(max_tokens=WARMUP_NEW_TOKENS, ignore_eos=True)
    timing = Timing("minisgl", [])
    startups, cached = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        with LLM(str(model), **minisgl_kwargs(args)) as llm:
            startups.append(time.perf_counter() - start)
            llm.generate([prompts[0][:WARMUP_PROMPT_TOKENS]], warmup)
            call, hits = timed_generate(llm, prompts, params)
            timing.calls.append(call)
            cached.append(hits)
    timing.notes.append("LLM start-up per round (excluded from throughput): "
                        + ", ".join(f"{s:.2f}" for s in startups) + " s")
    timing.notes.append(f"prefix-cache hit prompt tokens per timed call: {cached} "
                        f"of {sum(len(p) for p in prompts)}")
    return timing


# ----- HF transformers -------------------------------------------------------------------------


def load_hf(model: Path, pad_id: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop, never mask EOS (like ignore_eos)
    hf.generation_config.pad_token_id = pad_id
    return hf


def left_pad(prompts: Outputs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask, padded on the left to the longest prompt."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate(hf: Any, prompts: Outputs, max_tokens: int, pad_id: int) -> Outputs:
    """One greedy `generate` call on all `prompts`; the new tokens of each."""
    import torch

    ids, mask = left_pad(prompts, pad_id)
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                          max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          pad_token_id=pad_id)
    return out[:, ids.shape[1]:].tolist()


def bench_hf(model: Path, prompts: Outputs, args: argparse.Namespace, pad_id: int) -> list[Timing]:
    hf = load_hf(model, pad_id)
    hf_generate(hf, [prompts[0][:WARMUP_PROMPT_TOKENS]], WARMUP_NEW_TOKENS, pad_id)
    n, repeat = args.max_tokens, args.repeat
    batched = Timing("HF batched (left pad)", [
        timed_call(lambda: hf_generate(hf, prompts, n, pad_id)) for _ in range(repeat)])
    if args.skip_hf_sequential:
        return [batched]
    sequential = Timing("HF sequential (bs=1)", [
        timed_call(lambda: [hf_generate(hf, [p], n, pad_id)[0] for p in prompts])
        for _ in range(repeat)])
    return [batched, sequential]


# ----- report ----------------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_matches(mini: Timing, hf: list[Timing]) -> None:
    for ref in hf:
        pairs = list(zip(mini.outputs, ref.outputs))
        same = sum(a == b for a, b in pairs)
        diverge = [first_divergence(a, b) for a, b in pairs if a != b]
        extra = f"; the others first differ at positions {diverge}" if diverge else ""
        print(f"greedy tokens, minisgl vs {ref.name}: {same}/{len(pairs)} prompts with identical "
              f"{len(mini.outputs[0])}-token outputs{extra}")


def print_calls(timings: list[Timing]) -> None:
    """Per system: every timed call, and the busy cores during the best one (contention)."""
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    for t in timings:
        calls = ", ".join(f"{c.seconds:.3f}" for c in t.calls)
        best = t.best
        print(f"{t.name}: timed calls [{calls}] s; during the best one {fmt(best.own_cores)} "
              f"cores busy in this process tree, {fmt(best.other_cores)} in other processes")


def ratio(seconds: float, base: Timing | None) -> str:
    """Throughput relative to `base` (same token count, so a ratio of times)."""
    return "n/a" if base is None else f"{base.seconds / seconds:.2f}x"


def print_table(timings: list[Timing], total_tokens: int) -> None:
    batched = next((t for t in timings if t.name.startswith("HF batched")), None)
    sequential = next((t for t in timings if t.name.startswith("HF sequential")), None)
    header = ("system", "total time s", "output tok/s", "ratio vs HF batched",
              "ratio vs HF sequential")
    rows = [header] + [
        (t.name, f"{t.seconds:.3f}", f"{total_tokens / t.seconds:.1f}",
         ratio(t.seconds, batched), ratio(t.seconds, sequential)) for t in timings]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for k, r in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if k == 0:
            print("-+-".join("-" * w for w in widths))


def print_header(args: argparse.Namespace, load_start: tuple[float, ...], total: int) -> None:
    import torch
    import transformers

    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    load_end = os.getloadavg()
    print(f"machine: {platform.machine()}, os.cpu_count()={os.cpu_count()}, torch "
          f"{torch.__version__} (HF threads {torch.get_num_threads()}), transformers "
          f"{transformers.__version__}, python {platform.python_version()}; load average "
          f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    print(f"float32, greedy; {args.num_prompts} prompts x {args.max_tokens} new tokens = {total} "
          f"output tokens; best of {args.repeat}; minisgl settings {minisgl_kwargs(args)}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    load_start = os.getloadavg()
    model = ensure_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = make_prompts(tokenizer, args.num_prompts)
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, lengths {lengths} (min {min(lengths)}, max {max(lengths)}, "
          f"mean {sum(lengths) / len(lengths):.1f}); {args.max_tokens} new tokens each", flush=True)

    mini = bench_minisgl(model, prompts, args)
    print(f"minisgl done: {mini.seconds:.3f} s", flush=True)
    hf = bench_hf(model, prompts, args, pad_id)
    for t in (mini, *hf):
        check_lengths(t, args.max_tokens)

    total = args.num_prompts * args.max_tokens
    print()
    print_header(args, load_start, total)
    for note in mini.notes:
        print(f"minisgl {note}")
    print_matches(mini, hf)
    print_calls([mini, *hf])
    print()
    print_table([mini, *hf], total)


if __name__ == "__main__":
    main()
