"""Decode throughput at several batch sizes, next to the weight-read roofline and HF transformers.

A model of the chosen shape with random weights (`load_format="dummy"`) decodes `--new-tokens`
tokens for `--batch-size` prompts of `--prompt-len` random tokens. Prefill is excluded by
timing the same call with max_tokens=N and with max_tokens=1 (prefill + the first token) and
subtracting: the difference covers N-1 decode steps, so

    decode tok/s = batch * (N - 1) / (time(N) - time(1)),   ms/step = the difference / (N - 1).

Every batch size uses the same N (default 512); pass a smaller `--new-tokens` to shorten the
large batches' runs. Each timing is the best of `--repeats`, every call with fresh prompts (no
prefix-cache hits). The roofline (batch 1 only) is the measured device copy bandwidth over the
weight bytes one step must read; HF transformers runs `generate` on a same-shaped random model
(greedy, exactly N new tokens), timed the same way.

    python scripts/bench_decode.py                       # Llama-3.1-8B shape, bf16, on the GPU
    python scripts/bench_decode.py --device cpu --shape tiny-llama --batch-sizes 1 4 \
        --new-tokens 16                                 # smoke test
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minisgl_backend.benchmark.cli import (
    add_llm_args,
    add_model_args,
    engine_dtype,
    human_bytes,
    llm_kwargs,
    markdown_table,
    percent,
    model_folder,
    print_header,
    torch_device,
)
from minisgl_backend.benchmark.hardware import measure_roofline
from minisgl_backend.benchmark.workloads import fixed_workload
from minisgl_backend.models import ModelConfig

HEADER = ("batch", "new tokens", "decode tok/s", "ms/step", "roofline tok/s", "of roofline",
          "HF tok/s", "HF ms/step", "vs HF")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_llm_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=512, help="N, for every batch size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="bandwidth probe size (default 1024 MiB on GPU, 64 on CPU)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (one decode step at least)")
    return args


def decode_seconds(run: Callable[[int, int], None], repeats: int, new_tokens: int) -> float:
    """Best time(N) - best time(1); `run(max_tokens, seed)` generates for fresh prompts."""
    def best(max_tokens: int) -> float:
        times = []
        for r in range(repeats):
            start = time.perf_counter()
            run(max_tokens, 1000 * max_tokens + r)
            times.append(time.perf_counter() - start)
        return min(times)

    # A loaded machine can stall one short run past a long one; measure again, with more
    # repeats, before giving up.
    for _ in range(3):
        seconds = best(new_tokens) - best(1)
        if seconds > 0:
            return seconds
        repeats *= 2
    raise RuntimeError("decode time came out <= 0 (noise); use more --new-tokens")


def bench_minisgl(args: argparse.Namespace, folder: Path, vocab: int) -> dict[int, float]:
    from minisgl_backend import LLM

    kwargs = llm_kwargs(args)
    kwargs["max_running_requests"] = max(kwargs.get("max_running_requests", 0),
                                         *args.batch_sizes)
    results = {}
    with LLM(folder, **kwargs) as llm:
        for bs in args.batch_sizes:
            def run(max_tokens: int, seed: int, bs: int = bs) -> None:
                w = fixed_workload(vocab, bs, args.prompt_len, max_tokens, seed=seed)
                outs = llm.generate(w.prompts, w.params)
                assert all(len(o.token_ids) == max_tokens for o in outs)

            run(2, seed=1)  # warm up this batch size
            results[bs] = decode_seconds(run, args.repeats, args.new_tokens)
            print(f"minisgl batch {bs}: {results[bs]:.3f} s of decode", flush=True)
    return results


def bench_hf(args: argparse.Namespace, folder: Path, vocab: int,
             dtype: torch.dtype) -> dict[int, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch_device(args)
    with torch.device(device):  # HF initializes the random weights on the device: fast
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    model.eval()
    results = {}
    for bs in args.batch_sizes:
        def run(max_tokens: int, seed: int, bs: int = bs) -> None:
            w = fixed_workload(vocab, bs, args.prompt_len, max_tokens, seed=seed)
            ids = torch.tensor(w.prompts, device=device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     do_sample=False, max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            assert out.shape[1] == args.prompt_len + max_tokens

        run(2, seed=1)
        results[bs] = decode_seconds(run, args.repeats, args.new_tokens)
        print(f"HF batch {bs}: {results[bs]:.3f} s of decode", flush=True)
    return results


def table_rows(args: argparse.Namespace, mini: dict[int, float], hf: dict[int, float],
               roofline: float) -> list[list[str]]:
    steps = args.new_tokens - 1
    rows = []
    for bs in args.batch_sizes:
        tps = bs * steps / mini[bs]
        row = [str(bs), str(args.new_tokens), f"{tps:.1f}", f"{1e3 * mini[bs] / steps:.3f}"]
        row += [f"{roofline:.1f}", percent(tps / roofline)] if bs == 1 else ["-", "-"]
        if bs in hf:
            hf_tps = bs * steps / hf[bs]
            row += [f"{hf_tps:.1f}", f"{1e3 * hf[bs] / steps:.3f}", f"{tps / hf_tps:.2f}x"]
        else:
            row += ["-", "-", "-"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with model_folder(args) as (folder, config):
        dtype = engine_dtype(args, config)
        device = torch_device(args)
        copy_mib = args.copy_mib or (1024 if device.type == "cuda" else 64)
        roof = measure_roofline(ModelConfig.from_dict(config), dtype, device, args.tp_size or 1,
                                copy_mib)
        weights, bandwidth, roofline = roof.weights, roof.bandwidth, roof.tokens_per_s
        mini = bench_minisgl(args, folder, config["vocab_size"])
        hf = {} if args.skip_hf else bench_hf(args, folder, config["vocab_size"], dtype)
        print()
        print_header(args, config, dtype)
        step_bytes = weights.per_decode_step(1)
        print(f"copy bandwidth (read + write, median of 10 x {copy_mib} MiB): "
              f"{human_bytes(bandwidth)}/s; weight bytes read per batch-1 decode step (rank 0, "
              f"embedding table excluded, LM head once): {human_bytes(step_bytes)} of "
              f"{human_bytes(weights.total)} of parameters; weight-read floor "
              f"{1e3 * step_bytes / bandwidth:.3f} ms/step")
        print(f"prompts of {args.prompt_len} random tokens; decode = time(max_tokens="
              f"{args.new_tokens}) - time(max_tokens=1) = {args.new_tokens - 1} steps; "
              f"best of {args.repeats}; LLM settings {_settings(args)}")
        print()
        print(markdown_table(HEADER, table_rows(args, mini, hf, roofline)))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in llm_kwargs(args).items() if k not in ("device", "dtype")}


if __name__ == "__main__":
    main()
