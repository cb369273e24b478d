"""FP8 against the model's own dtype: accuracy on any device, speed on a GPU, side by side.

`accuracy` (real weights: --model, default the embedded model): three engines, `baseline`,
`fp8` (`quantization="fp8"`) and `fp8 + fp8 KV` (also `kv_cache_dtype="fp8_e4m3"`), each
computing the perplexity of perplexity_text.txt (expository prose, 2,727 tokens under the
default model's tokenizer) from the prompt's logits (`return_context_logits`):

    perplexity = exp(mean over the text's tokens after the first of -log p(token | before)),

the text prefilled in chunks of --chunked-prefill-size tokens (here 512 unless given), so
that attention reads the earlier chunks' K/V back from the pool (FP8 in the third run). The
target: within 3% of the baseline. Each engine also answers "What is the capital of France?"
(the chat template, greedy, 32 tokens): does the answer name Paris?

Speed (a GPU; --shape, random weights of a real shape), each FP8 run against the baseline:
`decode`: batch-1 decode tok/s (prefill taken out as `decode` does), bf16 against
`quantization="fp8"`, each against its roofline: the copy bandwidth over the weight bytes a
step reads (FP8: the projections at 1 byte with a float32 scale per output channel, the
embeddings, LM head and norms in the model's dtype); `offline`: the anchor workload
(`offline`'s options) through one `generate` call; `kv`: the decode step rate of each
--kv-batch count of requests of --kv-context random tokens (prefilled once, then taken from
the prefix cache; a smaller batch's prompts begin a larger one's), bf16 KV against
`kv_cache_dtype="fp8_e4m3"`, and each pool's capacity in tokens. A pool that cannot hold every
request at once is reported, not timed.

One engine per run; a speed engine runs each of its parts in turn. --json FILE writes the
header, the table and the unrounded results.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minisgl_backend.benchmark import cli, offline
from minisgl_backend.benchmark.hardware import Roofline, measure_roofline, weight_bytes
from minisgl_backend.benchmark.workloads import Workload, fixed_workload, text_workload
from minisgl_backend.core import SamplingParams
from minisgl_backend.models import ModelConfig
from minisgl_backend.settings import EngineSettings
from minisgl_backend.tokenizer import encode_prompt

if TYPE_CHECKING:
    from minisgl_backend import LLM

PARTS = ("accuracy", "decode", "offline", "kv")
TEXT_PATH = Path(__file__).with_name("perplexity_text.txt")
QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 32
PREFILL_CHUNK = 512
PERPLEXITY_TARGET = 1.03  # FP8's perplexity at most 3% above the baseline's
FP8_WEIGHTS = {"quantization": "fp8"}
FP8_KV = {"kv_cache_dtype": "fp8_e4m3"}
BASELINE = "baseline"
ACCURACY_RUNS = {BASELINE: {}, "fp8": FP8_WEIGHTS, "fp8 + fp8 KV": {**FP8_WEIGHTS, **FP8_KV}}
SPEED_RUNS = {BASELINE: {}, "fp8": FP8_WEIGHTS, "fp8 KV": FP8_KV}
# The speed engines each part runs on (the baseline first): one FP8 change at a time.
PART_RUNS = {"decode": (BASELINE, "fp8"), "offline": (BASELINE, "fp8"),
             "kv": (BASELINE, "fp8 KV")}
HEADER = ("part", "run", "figure", "value", "vs baseline", "detail")


@dataclass
class Result:
    """One run's figure of one part; `value` None: not measured (`detail` says why)."""

    part: str
    run: str
    figure: str
    value: float | None
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    offline.add_workload_args(parser)
    parser.add_argument("--parts", nargs="+", choices=PARTS,
                        help="default: accuracy with --model, decode offline kv with --shape")
    parser.add_argument("--text-tokens", type=int,
                        help="accuracy: only the text's first this many tokens (smoke tests)")
    parser.add_argument("--new-tokens", type=int, default=256, help="decode: T")
    parser.add_argument("--prompt-len", type=int, default=32, help="decode")
    parser.add_argument("--repeats", type=int, default=2, help="decode, kv: best of this many")
    parser.add_argument("--copy-mib", type=int, help="decode: bandwidth probe size")
    parser.add_argument("--kv-batch", type=int, nargs="+", default=[64],
                        help="kv: requests, one measurement per count")
    parser.add_argument("--kv-context", type=int, default=8192, help="kv: prompt tokens each")
    parser.add_argument("--kv-new-tokens", type=int, default=64, help="kv: T")
    parser.add_argument("--json", type=Path, help="also write the results to this file")


def parts_of(args: argparse.Namespace) -> list[str]:
    return args.parts or (["accuracy"] if args.shape is None else list(PARTS[1:]))


def text_ids(tokenizer: Any, limit: int | None = None) -> list[int]:
    """The perplexity text's token ids (the tokenizer's own special tokens added)."""
    ids = encode_prompt(tokenizer, TEXT_PATH.read_text())
    return ids[:limit] if limit else ids


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], row i of `logits` predicting
    ids[i + 1]."""
    if len(ids) < 2 or logits.shape[0] != len(ids):
        raise ValueError(f"need the logits of every one of >= 2 tokens, got {logits.shape[0]} "
                         f"rows for {len(ids)} tokens")
    logp = torch.from_numpy(logits[:-1]).float().log_softmax(-1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def accuracy_run(llm: LLM, run: str, ids: list[int]) -> Result:
    """The text's perplexity and the chat answer, in one `generate` call."""
    chat = text_workload(llm.tokenizer, [QUESTION], ANSWER_TOKENS, ignore_eos=False)
    text_out, answer = llm.generate(
        [ids, *chat.prompts], [SamplingParams(max_tokens=1, return_context_logits=True),
                               *chat.params])
    names_paris = "paris" in answer.text.lower()
    return Result("accuracy", run, "perplexity", perplexity(text_out.context_logits, ids),
                  f"names Paris: {'yes' if names_paris else 'no'}",
                  {"tokens": len(ids), "answer": answer.text, "names_paris": names_paris})


def accuracy(args: argparse.Namespace, folder: Path) -> list[Result]:
    results, chunk = [], args.chunked_prefill_size or PREFILL_CHUNK
    for run, settings in ACCURACY_RUNS.items():
        with cli.make_llm(args, folder, chunked_prefill_size=chunk, **settings) as llm:
            if llm.tokenizer is None:
                raise SystemExit(f"{folder}: accuracy needs a tokenizer in the model folder")
            results.append(accuracy_run(llm, run, text_ids(llm.tokenizer, args.text_tokens)))
        print(f"accuracy, {run}: perplexity {results[-1].value:.4f}", flush=True)
    return results


def generated(llm: LLM, workload: Workload) -> int:
    return sum(len(o.token_ids) for o in llm.generate(workload.prompts, workload.params))


def kv_run(args: argparse.Namespace, llm: LLM, run: str, vocab: int, batch: int) -> Result:
    """The decode step rate of `batch` requests of --kv-context tokens (the same prompts every
    call: after the warm-up's prefill, each call takes them from the prefix cache)."""
    cache = llm.scheduler.cache
    pool = cache.num_pages * cache.page_size
    per_request = -(-(args.kv_context + args.kv_new_tokens) // cache.page_size)
    needed = batch * per_request * cache.page_size
    extra = {"pool_tokens": pool, "needed_tokens": needed}
    part = f"kv {batch} x {args.kv_context}"
    if needed > pool:
        return Result(part, run, "steps/s", None, f"pool {pool:,} tokens < {needed:,} needed: "
                      f"not timed", extra)

    def call(tokens: int) -> int:
        return generated(llm, fixed_workload(vocab, batch, args.kv_context, tokens,
                                             seed=args.seed))

    rate = cli.decode_rates({"kv": call}, args.kv_new_tokens, args.repeats)["kv"]
    steps = rate.decode_tokens // batch
    extra.update(rows_at_once=llm.scheduler.peak_running, ms_per_step=1e3 * rate.seconds / steps)
    return Result(part, run, "steps/s", steps / rate.seconds,
                  f"pool {pool:,} tokens; {llm.scheduler.peak_running} rows at once; "
                  f"{1e3 * rate.seconds / steps:.3f} ms/step", extra)


def decode_run(args: argparse.Namespace, llm: LLM, run: str, vocab: int,
               roof: Roofline) -> Result:
    seeds = itertools.count()

    def call(tokens: int) -> int:
        return generated(llm, fixed_workload(vocab, 1, args.prompt_len, tokens,
                                             seed=next(seeds)))

    rate = cli.decode_rates({1: call}, args.new_tokens, args.repeats)[1]
    step_bytes = roof.weights.per_decode_step(1)
    return Result("decode batch 1", run, "tok/s", rate.per_s,
                  f"{cli.percent(rate.per_s / roof.tokens_per_s)} of its "
                  f"{roof.tokens_per_s:.1f} tok/s roofline ({cli.human_bytes(step_bytes)} a "
                  f"step)", {"roofline_tok_s": roof.tokens_per_s, "step_bytes": step_bytes,
                             "of_roofline": rate.per_s / roof.tokens_per_s})


def offline_run(args: argparse.Namespace, llm: LLM, run: str, vocab: int,
                workload: Workload) -> Result:
    seconds, _, _ = offline.time_workload(llm, workload, vocab, args.seed)
    return Result(f"offline {args.workload}", run, "output tok/s",
                  workload.output_tokens / seconds,
                  f"{len(workload)} requests, {workload.output_tokens:,} tokens in "
                  f"{seconds:.2f} s", {"seconds": seconds})


def rooflines(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Roofline]:
    """The batch-1 roofline of the baseline's weights and of FP8's (one bandwidth probe)."""
    model, dtype = ModelConfig.from_dict(config), cli.engine_dtype(args, config)
    roof = measure_roofline(model, dtype, cli.torch_device(args), args.tp_size or 1,
                            args.copy_mib)
    fp8 = weight_bytes(model, dtype, args.tp_size or 1, projection_dtype=torch.float8_e4m3fn)
    return {BASELINE: roof, "fp8": Roofline(roof.bandwidth, fp8)}


def speed(args: argparse.Namespace, folder: Path, config: dict[str, Any],
          parts: list[str]) -> list[Result]:
    vocab, results = config["vocab_size"], []
    roofs = rooflines(args, config) if "decode" in parts else {}
    workload = offline.make_workload(args, folder, vocab) if "offline" in parts else None
    overrides = {}
    if "kv" in parts and (args.max_running_requests
                          or EngineSettings().max_running_requests) < max(args.kv_batch):
        overrides["max_running_requests"] = max(args.kv_batch)
    # kv first: its rows-at-once count is the engine's peak before the other parts run
    order = [p for p in ("kv", "decode", "offline") if p in parts]
    for run, settings in SPEED_RUNS.items():
        mine = [p for p in order if run in PART_RUNS[p]]
        if not mine:
            continue
        with cli.make_llm(args, folder, **overrides, **settings) as llm:
            for part in mine:
                if part == "kv":
                    done = [kv_run(args, llm, run, vocab, batch)
                            for batch in sorted(args.kv_batch)]
                elif part == "decode":
                    done = [decode_run(args, llm, run, vocab, roofs[run])]
                else:
                    done = [offline_run(args, llm, run, vocab, workload)]
                for r in done:
                    value = "-" if r.value is None else f"{r.value:.2f}"
                    print(f"{r.part}, {run}: {value} {r.figure}; {r.detail}", flush=True)
                results += done
    return results


def vs_baseline(results: list[Result]) -> list[float | None]:
    """Each result's value over its part's baseline value (None where either is missing)."""
    base = {r.part: r.value for r in results if r.run == BASELINE}
    return [r.value / base[r.part] if r.value is not None and base.get(r.part) else None
            for r in results]


def by_part(results: list[Result]) -> list[Result]:
    """The results grouped by part (in the order the parts first ran), runs in their order."""
    order = list(dict.fromkeys(r.part for r in results))
    return sorted(results, key=lambda r: order.index(r.part))


def table_rows(results: list[Result]) -> list[list[str]]:
    rows = []
    for r, ratio in zip(results, vs_baseline(results)):
        detail = r.detail
        if r.part == "accuracy" and r.run != BASELINE and ratio is not None:
            detail += (f"; within {PERPLEXITY_TARGET - 1:.0%}: "
                       f"{'yes' if ratio <= PERPLEXITY_TARGET else 'no'}")
        rows.append([r.part, r.run, r.figure, "-" if r.value is None else f"{r.value:.4g}",
                     "-" if ratio is None else f"{ratio:.3f}x", detail])
    return rows


def notes_of(args: argparse.Namespace, results: list[Result], parts: list[str]) -> list[str]:
    notes = [f"answer, {r.run}: {r.extra['answer']!r}" for r in results if r.part == "accuracy"]
    if "accuracy" in parts:
        chunk = args.chunked_prefill_size or PREFILL_CHUNK
        notes.insert(0, f"accuracy: {TEXT_PATH.name}, {results[0].extra['tokens']} tokens, "
                        f"prefilled in chunks of {chunk}; the answers greedy, "
                        f"{ANSWER_TOKENS} tokens")
    if any(p in parts for p in PART_RUNS) and cli.torch_device(args).type != "cuda":
        notes.append("speed parts on a CPU: a smoke run, not the GPU figures")
    if "kv" in parts:
        notes.append(f"kv: {' and '.join(map(str, sorted(args.kv_batch)))} requests of "
                     f"{args.kv_context} random tokens, "
                     f"decode = t(max_tokens={args.kv_new_tokens}) - t(max_tokens=1), best of "
                     f"{args.repeats}")
    if "decode" in parts:
        notes.append(f"decode: prompts of {args.prompt_len} random tokens, decode = t(max_tokens="
                     f"{args.new_tokens}) - t(max_tokens=1), best of {args.repeats}")
    return notes


def run(args: argparse.Namespace) -> None:
    parts = parts_of(args)
    results: list[Result] = []
    with cli.model_folder(args) as (folder, config):
        if "accuracy" in parts:
            results += accuracy(args, folder)
        speed_parts = [p for p in parts if p in PART_RUNS]
        if speed_parts:
            results += speed(args, folder, config, speed_parts)
    results = by_part(results)
    cli.report(args, "each FP8 run against the baseline (the model's dtype) of its part; "
               "perplexity: lower is better", HEADER, table_rows(results), config,
               notes_of(args, results, parts), args.json,
               [{**asdict(r), "vs_baseline": ratio}
                for r, ratio in zip(results, vs_baseline(results))])
