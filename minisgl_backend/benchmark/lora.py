"""Decode with LoRA adapters against the base model, side by side.

Three engines at each batch size, measured as `decode` measures (calls of B fresh prompts
generating T and 1 tokens): `base` (LoRA off), `base, LoRA on` (the same batch on an engine
serving the adapters: what a batch without adapters pays) and `N adapters` (the rows cycling
through `--adapters` random adapters of rank `--rank` on all seven projections, in `max_loras`
= N slots). Targets at batch 64 with 8 rank-16 adapters: the adapter step at most 1.3x the base
step, the adapter-free one at most 1.02x.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.workloads import fixed_workload
from minisgl_backend.lora.config import ADAPTABLE, projection_shapes
from minisgl_backend.models import ModelConfig
from minisgl_backend.models.projections import MODULE_BLOCK

HEADER = ("run", "batch", "decode tok/s", "ms/step", "step vs base")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--adapters", type=int, default=8, help="distinct adapters (N)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128, help="T, for every batch size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings")


def write_random_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of `rank` on every adaptable projection of `config`'s dense layers
    (the attention projections of MoE layers), with small random A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out_features, in_features) in projection_shapes(config).items():
            block = MODULE_BLOCK[module]
            if block == "mlp" and config.is_moe_layer(layer):
                continue
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features,
                                                             generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank,
                                                             generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(ADAPTABLE), "bias": "none"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def run(args: argparse.Namespace) -> None:
    counter = itertools.count()
    rates = {}
    with cli.model_folder(args, tokenizer=False) as (folder, config), \
            tempfile.TemporaryDirectory() as tmp:
        model = ModelConfig.from_dict(config)
        names = [f"adapter{i}" for i in range(args.adapters)]
        setting = ",".join(f"{name}={write_random_adapter(Path(tmp) / name, model, args.rank, i)}"
                           for i, name in enumerate(names))
        lora = {"lora_adapters": setting, "max_loras": args.adapters,
                "max_lora_rank": args.rank}
        runs = [("base", {}, None), ("base, LoRA on", lora, None),
                (f"{args.adapters} adapters", lora, names)]
        running = max(args.max_running_requests or 0, *args.batch_sizes)
        for label, overrides, adapters in runs:
            with cli.make_llm(args, folder, max_running_requests=running, **overrides) as llm:
                def call(bs: int, max_tokens: int) -> int:
                    w = fixed_workload(config["vocab_size"], bs, args.prompt_len, max_tokens,
                                       seed=next(counter))
                    loras = None if adapters is None else [adapters[i % len(adapters)]
                                                           for i in range(bs)]
                    return sum(len(o.token_ids)
                               for o in llm.generate(w.prompts, w.params, lora=loras))

                for bs, rate in cli.decode_rates(
                        {bs: (lambda t, bs=bs: call(bs, t)) for bs in args.batch_sizes},
                        args.new_tokens, args.repeats).items():
                    rates[label, bs] = rate
                    print(f"{label}, batch {bs}: {rate.per_s:.1f} tok/s", flush=True)
    steps = args.new_tokens - 1
    rows = [[label, str(bs), f"{r.per_s:.1f}", f"{1e3 * r.seconds / steps:.3f}",
             f"{r.seconds / rates['base', bs].seconds:.3f}x"]
            for (label, bs), r in rates.items()]
    cli.report(args, "each run's decode step against the base engine's at its batch size",
               HEADER, rows, config, [
                   f"{args.adapters} random adapters of rank {args.rank} on q/k/v/o and "
                   f"gate/up/down; prompts of {args.prompt_len} random tokens; decode = "
                   f"t(max_tokens={args.new_tokens}) - t(max_tokens=1); best of {args.repeats}"])
