"""Offline CPU throughput: minisgl_backend's `LLM.generate` next to HF transformers `generate`.

All three systems run the default model (SmolLM2-135M-Instruct) in float32 on CPU, in one run,
on the same token ids: 16 deterministic chat-templated prompts of varied lengths (about 30 to 200
tokens), tokenized once, each generating exactly 64 new tokens greedily.

* minisgl: `LLM(model, device="cpu")`, one short warm-up `generate`, then one timed `generate` of
  all prompts (the engine runs in its own process, which uses all cores). The start-up time of
  the `LLM` (engine process spawn and model load) is reported but excluded from throughput.
* HF batched: one `model.generate` call on all prompts, left-padded with an attention mask.
* HF sequential: one `model.generate` call per prompt (batch size 1, no padding).

HF runs in this process with `torch.set_num_threads(os.cpu_count())`, after the minisgl engine
has shut down, so the two never compete for cores. Each timed call is wall time; output tok/s is
`num_prompts * max_tokens / time`; `--repeat N` keeps the best of N calls.

Fixed-length decoding: minisgl uses `ignore_eos=True` (EOS is not stop, and is not masked
either). HF gets `min_new_tokens = max_new_tokens`, and its generation config has no EOS id so
that it neither stops nor masks EOS; both systems then follow the same greedy argmax. The greedy
tokens of minisgl are compared with HF sequential (HF batched with padding may legitimately
differ slightly through float rounding).

Usage::

    python scripts/bench_offline_cpu.py [--num-prompts 16] [--max-tokens 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

SCRIPTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS_DIR))
from build_default_model import DEFAULT_MODEL_DIR, build_default_model  # noqa: E402

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
# Context sentences per prompt: spreads prompt lengths from ~30 to ~200 tokens.
CONTEXT_COUNTS = (0, 11, 2, 7, 0, 5, 9, 1, 12, 3, 6, 0, 10, 4, 8, 12)


@dataclass
class Timing:
    """The best wall time of a system over `--repeat` calls, and its generated tokens.

    `own_cores` / `other_cores`: average cores busy during the best call in this process tree
    (this process and its children, e.g. the engine) and in all other processes (contention).
    """

    name: str
    seconds: float
    outputs: list[list[int]]
    all_seconds: list[float] = field(default_factory=list)
    own_cores: float | None = None
    other_cores: float | None = None
    note: str = ""


@dataclass
class CpuSample:
    """Busy CPU time (s) of the whole machine and of this process tree, at one instant."""

    wall: float
    system_busy: float | None
    tree_busy: float | None

    @classmethod
    def now(cls) -> CpuSample:
        return cls(time.perf_counter(), _system_busy_seconds(), _tree_busy_seconds(os.getpid()))


def _system_busy_seconds() -> float | None:
    """Non-idle CPU seconds of all cores since boot (Linux /proc/stat), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # fields after "pid (comm)"
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _tree_busy_seconds(root: int) -> float | None:
    """CPU seconds used so far by `root` and its live descendants (Linux /proc), or None."""
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


def cores_used(before: CpuSample, after: CpuSample) -> tuple[float | None, float | None]:
    """Average busy cores of this process tree and of everything else between two samples."""
    wall = after.wall - before.wall
    if None in (before.system_busy, before.tree_busy, after.system_busy, after.tree_busy):
        return None, None
    own = (after.tree_busy - before.tree_busy) / wall  # type: ignore[operator]
    system = (after.system_busy - before.system_busy) / wall  # type: ignore[operator]
    return own, max(0.0, system - own)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="HF model folder")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (fixed)")
    p.add_argument("--repeat", type=int, default=1, help="timed calls per system; best is kept")
    p.add_argument("--page-size", type=int, default=None, help="minisgl page_size")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="minisgl chunked_prefill_size")
    p.add_argument("--max-total-tokens", type=int, default=None, help="minisgl KV pool tokens")
    p.add_argument("--skip-hf-sequential", action="store_true",
                   help="skip the one-prompt-at-a-time HF baseline")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def ensure_model(model: str) -> Path:
    path = Path(model)
    if path.resolve() == DEFAULT_MODEL_DIR.resolve() and not (path / "config.json").is_file():
        print(f"building the default model into {path} ...", flush=True)
        build_default_model(path)
    return path


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
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


def best_of(name: str, repeat: int, fn: Callable[[], list[list[int]]]) -> Timing:
    """Run `fn` `repeat` times: the best wall time, its CPU usage, the first call's outputs."""
    best: Timing | None = None
    all_seconds: list[float] = []
    for _ in range(repeat):
        before = CpuSample.now()
        outputs = fn()
        after = CpuSample.now()
        seconds = after.wall - before.wall
        all_seconds.append(seconds)
        if best is None or seconds < best.seconds:
            own, other = cores_used(before, after)
            first = best.outputs if best is not None else outputs
            best = Timing(name, seconds, first, own_cores=own, other_cores=other)
    assert best is not None
    best.all_seconds = all_seconds
    return best


def check_lengths(name: str, outputs: list[list[int]], max_tokens: int) -> None:
    bad = [i for i, o in enumerate(outputs) if len(o) != max_tokens]
    if bad:
        raise RuntimeError(f"{name}: prompts {bad} did not generate exactly {max_tokens} tokens")


# ----- minisgl ----------------------------------------------------------------------------------


def minisgl_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"device": "cpu", "dtype": "float32"}
    if args.page_size is not None:
        kwargs["page_size"] = args.page_size
    if args.chunked_prefill_size is not None:
        kwargs["chunked_prefill_size"] = args.chunked_prefill_size
    if args.max_total_tokens is not None:
        kwargs["max_total_tokens"] = args.max_total_tokens
    return kwargs


def bench_minisgl(model: Path, prompts: list[list[int]],
                  args: argparse.Namespace) -> tuple[Timing, float]:
    """The timed minisgl run and the LLM start-up time."""
    from minisgl_backend import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    with LLM(str(model), **minisgl_kwargs(args)) as llm:
        startup = time.perf_counter() - start
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        cached: list[int] = []

        def run() -> list[list[int]]:
            outs = llm.generate(prompts, params)
            cached.append(sum(o.cached_tokens for o in outs))
            return [list(o.token_ids) for o in outs]

        timing = best_of("minisgl", args.repeat, run)
    timing.note = f"prefix-cache hit tokens per call: {cached}"
    return timing, startup


# ----- HF transformers ---------------------------------------------------------------------------


def load_hf(model: Path, pad_id: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop, never mask EOS (like ignore_eos)
    hf.generation_config.pad_token_id = pad_id
    return hf


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate(hf: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> list[list[int]]:
    """One batched greedy `generate` call; the new tokens of each prompt."""
    import torch

    ids, mask = left_pad(prompts, pad_id)
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                          max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          pad_token_id=pad_id)
    return out[:, ids.shape[1]:].tolist()


def bench_hf(model: Path, prompts: list[list[int]], args: argparse.Namespace,
             pad_id: int) -> list[Timing]:
    hf = load_hf(model, pad_id)
    hf_generate(hf, [prompts[0][:8]], 4, pad_id)  # warm-up
    n, repeat = args.max_tokens, args.repeat
    timings = [best_of("HF batched (left pad)", repeat,
                       lambda: hf_generate(hf, prompts, n, pad_id))]
    if not args.skip_hf_sequential:
        timings.append(best_of("HF sequential (bs=1)", repeat,
                               lambda: [hf_generate(hf, [p], n, pad_id)[0] for p in prompts]))
    return timings


# ----- report -----------------------------------------------------------------------------------


def count_matches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ratio(seconds: float, base: Timing | None) -> str:
    """Throughput of a system relative to `base` (same token count, so a ratio of times)."""
    return "n/a" if base is None else f"{base.seconds / seconds:.2f}x"


def print_table(timings: list[Timing], total_tokens: int) -> None:
    by_name = {t.name.split(" (")[0]: t for t in timings}
    batched, sequential = by_name.get("HF batched"), by_name.get("HF sequential")
    header = ("system", "total time s", "output tok/s", "ratio vs HF batched",
              "ratio vs HF sequential")
    rows = [header]
    for t in timings:
        tps = total_tokens / t.seconds
        rows.append((t.name, f"{t.seconds:.3f}", f"{tps:.1f}", ratio(t.seconds, batched),
                     ratio(t.seconds, sequential)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for k, r in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(r, widths)))
        if k == 0:
            print("-+-".join("-" * w for w in widths))


def print_cpu(timings: list[Timing]) -> None:
    """Per system: every timed call, and the cores busy during the best one (contention)."""
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    for t in timings:
        calls = ", ".join(f"{s:.3f}" for s in t.all_seconds)
        print(f"{t.name}: calls [{calls}] s; during the best call: {fmt(t.own_cores)} cores busy "
              f"in this process tree, {fmt(t.other_cores)} in other processes")


def print_matches(mini: Timing, hf: list[Timing]) -> None:
    for ref in hf:
        n = count_matches(mini.outputs, ref.outputs)
        diverge = [first_divergence(a, b) for a, b in zip(mini.outputs, ref.outputs) if a != b]
        extra = f" (first differing position of the others: {diverge})" if diverge else ""
        print(f"greedy match minisgl vs {ref.name}: {n}/{len(mini.outputs)} prompts with "
              f"identical {len(mini.outputs[0])}-token outputs{extra}")


def machine_line() -> str:
    import torch

    return (f"machine: {platform.machine()} {platform.processor() or ''}, os.cpu_count()="
            f"{os.cpu_count()}, torch {torch.__version__} (threads {torch.get_num_threads()}), "
            f"python {platform.python_version()}, loadavg at end {os.getloadavg()}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    model = ensure_model(args.model)
    load_before = os.getloadavg()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = make_prompts(tokenizer, args.num_prompts)
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, lengths {lengths} (min {min(lengths)}, max {max(lengths)}, "
          f"mean {sum(lengths) / len(lengths):.1f}); {args.max_tokens} new tokens each", flush=True)

    mini, startup = bench_minisgl(model, prompts, args)
    check_lengths(mini.name, mini.outputs, args.max_tokens)
    print(f"minisgl done: {mini.seconds:.3f} s; {mini.note}", flush=True)
    hf = bench_hf(model, prompts, args, pad_id)
    for t in hf:
        check_lengths(t.name, t.outputs, args.max_tokens)

    total = args.num_prompts * args.max_tokens
    print()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(machine_line() + f", loadavg at start {load_before}")
    print(f"transformers {transformers.__version__}; float32; greedy; "
          f"{args.num_prompts} prompts x {args.max_tokens} new tokens = {total} output tokens; "
          f"best of {args.repeat}")
    print(f"minisgl LLM start-up (excluded from throughput): {startup:.2f} s; settings "
          f"{minisgl_kwargs(args)}; {mini.note}")
    print_matches(mini, hf)
    print_cpu([mini, *hf])
    print()
    print_table([mini, *hf], total)


if __name__ == "__main__":
    main()
