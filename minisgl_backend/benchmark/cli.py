"""What the subcommands share: the model and engine options, the one place an `LLM` is made,
the report (header and table) and the decode-rate timing."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minisgl_backend.benchmark.shapes import SHAPES, describe, shape_config, write_config
from minisgl_backend.benchmark.tokenizer import TOKENIZERS_DIR, write_tokenizer
from minisgl_backend.engine.config import EngineConfig, resolve_dtype
from minisgl_backend.fields import Spec, specs_of
from minisgl_backend.settings import EngineSettings, parse_text

if TYPE_CHECKING:
    from minisgl_backend import LLM

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model (real weights) or --shape (random weights of a real model's shape)."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                       help="a HF model folder (default: the embedded default model)")
    group.add_argument("--shape", choices=sorted(SHAPES),
                       help="instead of --model: random weights of this shape (tiny-*: smoke)")
    group.add_argument("--num-layers", type=int, help="with --shape: this many layers")
    group.add_argument("--vocab-size", type=int, help="with --shape: this vocabulary size")
    group.add_argument("--tokenizer", choices=sorted(d.name for d in TOKENIZERS_DIR.iterdir()
                                                     if d.is_dir()),
                       help="with --shape: this committed tokenizer instead of the shape's")


def add_llm_args(parser: argparse.ArgumentParser) -> None:
    """Every engine setting (`EngineSettings`) as an option of its name (`--page-size 16`,
    `--overlap false`), checked as the Triton parameters are; passed to `LLM` only when given.
    `load_format` follows from --model / --shape."""
    group = parser.add_argument_group("engine settings")
    for name, (spec, default) in specs_of(EngineSettings).items():
        if name != "load_format":
            group.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE",
                               type=functools.partial(_setting, name, spec),
                               help=f"{spec.doc} (default {default!r})".replace("%", "%%"))


def _setting(name: str, spec: Spec, text: str) -> Any:
    try:
        return parse_text(name, spec, text)
    except ValueError as exc:  # argparse shows this message, naming the setting
        raise argparse.ArgumentTypeError(str(exc)) from None


def llm_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from the options (random weights with --shape);
    `overrides` win."""
    kwargs = {name: getattr(args, name) for name in specs_of(EngineSettings)
              if getattr(args, name, None) is not None}
    if getattr(args, "shape", None):
        kwargs["load_format"] = "dummy"
    return {**kwargs, **overrides}


def make_llm(args: argparse.Namespace, folder: Path, synthetic_acceptance: float | None = None,
             **overrides: Any) -> LLM:
    """The benchmarks' one way to an `LLM`: the options' settings with `overrides`;
    `synthetic_acceptance` keeps each draft token with that probability (random weights)."""
    from minisgl_backend import LLM
    from minisgl_backend.settings import EngineHooks

    hooks = None if synthetic_acceptance is None else EngineHooks(
        synthetic_acceptance=synthetic_acceptance)
    return LLM(folder, hooks=hooks, **llm_kwargs(args, **overrides))


def settings_text(args: argparse.Namespace) -> str:
    return str({k: v for k, v in llm_kwargs(args).items() if k not in ("device", "dtype")})


def add_vary_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vary", nargs="+", action="append", default=[], metavar="NAME=VALUE",
                        help="also run with these engine settings changed, e.g. --vary "
                             "cuda_graph_max_bs=0 --vary overlap=false (repeatable)")


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """("default", {}) and each --vary as (its text, its `LLM` overrides)."""
    from minisgl_backend.settings import parse_text, setting_specs

    specs, runs = setting_specs(), [("default", {})]
    for items in args.vary:
        pairs = [item.partition("=") for item in items]
        if any(name not in specs or not sep for name, sep, _ in pairs):
            raise SystemExit(f"--vary takes SETTING=VALUE items, got {items}")
        runs.append((" ".join(items), {k: parse_text(k, specs[k][0], v) for k, _, v in pairs}))
    return runs


@contextmanager
def model_folder(args: argparse.Namespace,
                 tokenizer: bool = True) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The model folder and its config: --model's, or a temporary one holding the shape's
    config.json and (with `tokenizer`) its benchmark tokenizer, so that `LLM` detokenizes."""
    if args.shape is None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"{args.model}: no model (the default one is built by "
                             f"`python scripts/build_default_model.py`)")
        yield args.model, json.loads((args.model / "config.json").read_text())
        return
    config = shape_config(args.shape, args.num_layers, args.vocab_size)
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.shape}-") as tmp:
        folder = write_config(config, tmp)
        if tokenizer:
            write_tokenizer(args.shape, config["vocab_size"], folder, args.tokenizer)
        yield folder, config


def torch_device(args: argparse.Namespace) -> torch.device:
    """The device the engine will run on (rank 0), as `EngineConfig` resolves "auto"."""
    return torch.device(EngineConfig(device=getattr(args, "device", None) or "auto").device_type)


def engine_dtype(args: argparse.Namespace, config: dict[str, Any]) -> torch.dtype:
    """The dtype the engine will run in (as `EngineConfig` resolves "auto")."""
    return resolve_dtype(getattr(args, "dtype", None) or "auto", torch_device(args).type,
                         config.get("torch_dtype", "float32"))


def header_fields(args: argparse.Namespace, compared: str,
                  config: dict[str, Any] | None = None) -> dict[str, str]:
    """Command, date, device, model and what the table compares."""
    device = torch_device(args)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()})")
    fields = {
        "command": shlex.join(["python", "-m", "minisgl_backend.benchmark", *sys.argv[1:]]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": f"{name}; torch {torch.__version__}"}
    if config is not None:
        weights = f"shape {args.shape}, random weights" if args.shape else str(args.model)
        fields["model"] = (f"{weights} ({describe(config)}), {engine_dtype(args, config)}; "
                           f"engine settings {settings_text(args)}")
    return {**fields, "compared": compared}


def print_header(args: argparse.Namespace, compared: str,
                 config: dict[str, Any] | None = None) -> dict[str, str]:
    """Print `header_fields` and return them."""
    fields = header_fields(args, compared, config)
    print("\n" + "\n".join(f"{key}: {value}" for key, value in fields.items()))
    return fields


def report(args: argparse.Namespace, compared: str, header: Sequence[str],
           rows: Sequence[Sequence[str]], config: dict[str, Any] | None = None,
           notes: Sequence[str] = (), json_path: Path | None = None,
           results: Any = None) -> None:
    """The header, `notes`, then the table (always the output's end). With `json_path`, the
    same (the table as one object per row) and `results` (numbers unrounded) go there too."""
    fields = print_header(args, compared, config)
    print("\n".join([*notes, ""]))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(
            {**fields, "notes": list(notes),
             "table": [dict(zip(header, row)) for row in rows], "results": results},
            indent=2) + "\n")
    print(markdown_table(header, rows))


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


@dataclass
class Rate:
    """Decode with prefill taken out: the calls of max_tokens T and of 1, best of each."""

    tokens: int  # generated by the T call
    decode_tokens: int  # tokens(T) - tokens(1)
    seconds: float  # best t(T) - best t(1)

    @property
    def per_s(self) -> float:
        return self.decode_tokens / self.seconds


def decode_rates(calls: dict[Hashable, Callable[[int], int]], max_tokens: int,
                 repeats: int) -> dict[Hashable, Rate]:
    """Each `call(max_tokens)` generates (for fresh prompts) and returns its token count. After a
    warm-up call each, `repeats` rounds time every call with T = `max_tokens` and with 1, in
    forward order on even rounds and reversed on odd ones (drift falls on all alike). A loaded
    machine can stall a short call past a long one: more rounds follow, up to twice."""
    best: dict[tuple[Hashable, int], tuple[float, int]] = {}
    for call in calls.values():
        call(2)
    for attempt in range(3):
        for round_ in range(repeats * 2**attempt):
            order = list(calls) if round_ % 2 == 0 else list(reversed(calls))
            for key in order:
                for tokens in (max_tokens, 1):
                    start = time.perf_counter()
                    count = calls[key](tokens)
                    seconds = time.perf_counter() - start
                    best[key, tokens] = min(best.get((key, tokens), (seconds, count)),
                                            (seconds, count))
        rates = {key: Rate(best[key, max_tokens][1], best[key, max_tokens][1] - best[key, 1][1],
                           best[key, max_tokens][0] - best[key, 1][0]) for key in calls}
        if all(r.seconds > 0 for r in rates.values()):
            return rates
    raise RuntimeError("decode time came out <= 0 (noise); use more tokens")
