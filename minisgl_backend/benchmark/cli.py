"""What the benchmark scripts share: options, the dummy-weight model folder, the report."""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from minisgl_backend.benchmark.shapes import SHAPES, describe, shape_config, write_config
from minisgl_backend.benchmark.tokenizer import write_tokenizer
from minisgl_backend.engine.config import EngineConfig, resolve_dtype


def add_model_args(parser: argparse.ArgumentParser, default_shape: str = "llama-3.1-8b") -> None:
    parser.add_argument("--shape", default=default_shape, choices=sorted(SHAPES),
                        help="model shape (random weights from config.json; tiny-*: CPU smoke)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="override the shape's number of layers")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto",
                        help="auto (the shape's bfloat16 on GPU, float32 on CPU), bfloat16, ...")


def add_llm_args(parser: argparse.ArgumentParser) -> None:
    """Engine settings, passed to `LLM` only when given (its defaults otherwise)."""
    group = parser.add_argument_group("engine settings")
    group.add_argument("--tp-size", type=int, default=None)
    group.add_argument("--page-size", type=int, default=None)
    group.add_argument("--max-running-requests", type=int, default=None)
    group.add_argument("--chunked-prefill-size", type=int, default=None)
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV pool size in tokens (default: what fits the device)")
    group.add_argument("--attention-backend", default=None)
    group.add_argument("--cuda-graph-max-bs", type=int, default=None,
                       help="decode batches up to this size replay CUDA graphs; 0: off")
    group.add_argument("--no-overlap", action="store_true", help="turn overlap scheduling off")
    group.add_argument("--fused-gemv-max-bs", type=int, default=None,
                       help="decode batches up to this size run fused few-rows GEMVs; 0: off")
    group.add_argument("--mixed-prefill", action="store_true",
                       help="prefill steps also decode one token of every running request")
    group.add_argument("--grammar-workers", type=int, default=None,
                       help="processes filling guided token masks (default: the engine's)")


_LLM_OPTIONS = ("tp_size", "page_size", "max_running_requests", "chunked_prefill_size",
                "max_total_tokens", "attention_backend", "cuda_graph_max_bs",
                "fused_gemv_max_bs", "grammar_workers")


def llm_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from the options; `overrides` win."""
    kwargs: dict[str, Any] = {"load_format": "dummy", "device": args.device, "dtype": args.dtype}
    for name in _LLM_OPTIONS:
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "no_overlap", False):
        kwargs["overlap"] = False
    if getattr(args, "mixed_prefill", False):
        kwargs["mixed_prefill"] = True
    kwargs.update(overrides)
    return kwargs


@contextmanager
def model_folder(args: argparse.Namespace,
                 tokenizer: bool = False) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A temporary folder holding the shape's config.json, and that config. With `tokenizer`,
    the folder holds the shape's benchmark tokenizer too (or the one `args.tokenizer` names),
    so that `LLM` detokenizes outputs."""
    config = shape_config(args.shape, args.num_layers, getattr(args, "vocab_size", None))
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.shape}-") as tmp:
        folder = write_config(config, tmp)
        if tokenizer:
            write_tokenizer(args.shape, config["vocab_size"], folder,
                            getattr(args, "tokenizer", None))
        yield folder, config


def torch_device(args: argparse.Namespace) -> torch.device:
    """The device the engine will run on (rank 0), as `EngineConfig` resolves "auto"."""
    return torch.device(EngineConfig(model_dir="", device=args.device).device_type)


def engine_dtype(args: argparse.Namespace, config: dict[str, Any]) -> torch.dtype:
    """The dtype the engine will run in (as `EngineConfig` resolves "auto")."""
    device_type = torch_device(args).type
    return resolve_dtype(args.dtype, device_type, config.get("torch_dtype", "float32"))


def device_name(args: argparse.Namespace) -> str:
    if torch_device(args).type == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()})"


def print_header(args: argparse.Namespace, config: dict[str, Any], dtype: torch.dtype) -> None:
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"device: {device_name(args)}; torch {torch.__version__}")
    print(f"shape: {args.shape} ({describe(config)}), {dtype}, dummy weights")


def human_bytes(n: float) -> str:
    """Decimal units: 16.06 GB, 4.12 TB."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.4g} {unit}"


def percent(ratio: float) -> str:
    """A share with one decimal, or three significant digits when it is below 1% (a tiny model's
    share of a CPU roofline must not print as 0.0%)."""
    return f"{ratio:.1%}" if abs(ratio) >= 0.01 or ratio == 0 else f"{100 * ratio:.3g}%"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
