"""Which FP8 scheme a checkpoint uses, read from its `quantization_config`, or asked for online.

Four published layouts load (each parsed strictly: a field the engine would read differently
fails naming it):

- `quant_method: "fp8"` with `weight_block_size`: e4m3 weights with one `weight_scale_inv` per
  block, activations quantized per token and block-wide column group at run time (Qwen3's FP8
  releases);
- `quant_method: "fp8"` per tensor: one `weight_scale` per weight, and an `input_scale` when
  `activation_scheme` is `static` (else activations per token);
- `compressed-tensors` float-quantized: `weight_scale` per channel, per tensor or per block;
  activations dynamic per token (per group with block weights) or static per tensor; its
  `ignore` list;
- ModelOpt FP8 (`quant_method: "modelopt"`, `quant_algo: "FP8"`): per-tensor weight and static
  input scales, `exclude_modules`.

`quantization="fp8"` on a checkpoint without FP8 weights quantizes its linear layers at load,
per output channel, activations per token.

Inside the engine every FP8 weight has one of two scale layouts: per output channel [N, 1]
(per-tensor scales are broadcast to their rows, which also lets q/k/v or gate/up with different
scales share one GEMM) or per block [ceil(N/bn), ceil(K/bk)]. Merged projections share one
static input scale, the largest of their parts' (the parts read the same input, so calibrated
checkpoints give them equal scales). With tensor parallelism a row-parallel layer (o_proj,
down_proj) quantizes its input per token over its rank's columns, as vLLM and SGLang do: the
ranks never exchange activation scales.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUANTIZATION_SETTINGS = ("auto", "fp8")


@dataclass(frozen=True)
class QuantScheme:
    """How the linear layers hold FP8 weights and quantize their inputs."""

    source: str  # "fp8", "compressed-tensors", "modelopt" or "online"
    weights: str  # "block", "channel" or "tensor": the checkpoint's weight scales
    block: tuple[int, int] | None = None  # (rows, columns) of a weight-scale block
    static_inputs: bool = False  # inputs quantized with the checkpoint's `input_scale`
    ignore: tuple[str, ...] = ()  # modules the checkpoint leaves unquantized
    scale_name: str = "weight_scale"  # the checkpoint's name of a weight's scale tensor

    @property
    def online(self) -> bool:
        return self.source == "online"

    @property
    def input_group(self) -> int:
        """Columns per dynamic input scale (0: one per token)."""
        return self.block[1] if self.block else 0

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. `model.layers.0.self_attn.q_proj`)
        holds FP8 weights."""
        return not any(_matches(entry, module) for entry in self.ignore)

    @property
    def label(self) -> str:
        """Short name for metrics labels: `fp8/<source>/<weight scales>`."""
        weights = f"block{self.block[0]}x{self.block[1]}" if self.block else self.weights
        return f"fp8/{self.source}/{weights}"

    def describe(self) -> str:
        weights = (f"{self.block[0]}x{self.block[1]} blocks" if self.block else
                   {"channel": "per output channel", "tensor": "per tensor"}[self.weights])
        if self.static_inputs:
            inputs = "static per-tensor input scales"
        else:
            inputs = (f"inputs per token and {self.block[1]} columns" if self.block
                      else "inputs per token")
        return f"FP8 e4m3 ({self.source}: weights {weights}, {inputs})"


def _matches(entry: str, module: str) -> bool:
    """An ignore-list entry: `re:` a regular expression (compressed-tensors), a wildcard
    pattern (ModelOpt), or a module name matching it or a module under it."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(module, entry)
    return (module == entry or module.startswith(entry + ".") or module.endswith("." + entry)
            or entry.endswith("." + module))  # a multimodal checkpoint's nested name


ONLINE = QuantScheme(source="online", weights="channel")


def resolve_scheme(model_dir: str | Path, setting: str = "auto") -> QuantScheme | None:
    """The scheme of the checkpoint in `model_dir` (None: not quantized), or the online one
    that `setting="fp8"` asks for where the checkpoint has none."""
    if setting not in QUANTIZATION_SETTINGS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_SETTINGS}, got {setting!r}")
    scheme = checkpoint_scheme(model_dir)
    if scheme is None and setting == "fp8":
        return ONLINE
    return scheme


def checkpoint_scheme(model_dir: str | Path) -> QuantScheme | None:
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    raw = config.get("quantization_config")
    if raw is None and (folder / "hf_quant_config.json").is_file():  # ModelOpt's own file
        raw = {"quant_method": "modelopt",
               **json.loads((folder / "hf_quant_config.json").read_text())}
    if raw is None:
        return None
    return parse_quantization_config(raw)


def parse_quantization_config(raw: Any) -> QuantScheme:
    """A checkpoint's `quantization_config`; ValueError naming the field it cannot serve."""
    if not isinstance(raw, dict):
        raise ValueError(f"config field 'quantization_config' must be an object, got {raw!r}")
    method = raw.get("quant_method")
    parsers = {"fp8": _parse_fp8, "compressed-tensors": _parse_compressed_tensors,
               "modelopt": _parse_modelopt}
    if method not in parsers:
        raise ValueError(f"config field 'quantization_config.quant_method' = {method!r} is not "
                         f"supported (supported: {', '.join(parsers)})")
    return parsers[method](raw)


def _field(path: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"config field 'quantization_config.{path}' = {value!r} is not supported "
                      f"(expected {expected})")


def _block(path: str, value: Any) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _field(path, value, "two positive integers [rows, columns]")
    return int(value[0]), int(value[1])


def _names(path: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field(path, value, "a list of module names")
    return tuple(value)


def _parse_fp8(raw: dict[str, Any]) -> QuantScheme:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _field("fmt", fmt, "'e4m3'")
    activation = raw.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise _field("activation_scheme", activation, "'dynamic' or 'static'")
    ignore = _names("ignored_layers", raw.get("ignored_layers")) + \
        _names("modules_to_not_convert", raw.get("modules_to_not_convert"))
    block_size = raw.get("weight_block_size")
    if block_size is None:
        return QuantScheme(source="fp8", weights="tensor", static_inputs=activation == "static",
                           ignore=ignore)
    if activation != "dynamic":
        raise _field("activation_scheme", activation,
                     "'dynamic' with weight_block_size (block-wise weights quantize their "
                     "inputs per token and group)")
    return QuantScheme(source="fp8", weights="block",
                       block=_block("weight_block_size", block_size), ignore=ignore,
                       scale_name="weight_scale_inv")


def _float8(path: str, args: Any) -> dict[str, Any]:
    """A compressed-tensors quantization-args object that must describe 8-bit floats."""
    if not isinstance(args, dict):
        raise _field(path, args, "an object")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise _field(path, {k: args.get(k) for k in ("num_bits", "type")},
                     "num_bits 8 and type 'float' (FP8)")
    if args.get("symmetric", True) is not True:
        raise _field(f"{path}.symmetric", args.get("symmetric"), "true")
    return args


def _parse_compressed_tensors(raw: dict[str, Any]) -> QuantScheme:
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _field("format", fmt, "'float-quantized' or 'naive-quantized'")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _field("config_groups", groups, "one scheme group (mixed schemes are not "
                     "implemented)")
    (name, group), = groups.items()
    path = f"config_groups.{name}"
    if not isinstance(group, dict) or "Linear" not in (group.get("targets") or []):
        raise _field(f"{path}.targets", group.get("targets") if isinstance(group, dict)
                     else group, "a list holding 'Linear'")
    weights = _float8(f"{path}.weights", group.get("weights"))
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _field(f"{path}.weights.strategy", strategy, "'tensor', 'channel' or 'block'")
    if weights.get("dynamic", False):
        raise _field(f"{path}.weights.dynamic", weights.get("dynamic"), "false")
    block = _block(f"{path}.weights.block_structure", weights.get("block_structure")) \
        if strategy == "block" else None
    inputs = group.get("input_activations")
    if inputs is None:
        raise _field(f"{path}.input_activations", inputs,
                     "FP8 inputs (weight-only FP8 is not implemented)")
    inputs = _float8(f"{path}.input_activations", inputs)
    if inputs.get("dynamic") is True:
        wanted = "group" if block else "token"
        if inputs.get("strategy") != wanted:
            raise _field(f"{path}.input_activations.strategy", inputs.get("strategy"),
                         f"{wanted!r} for dynamic inputs with {strategy} weight scales")
        if block and inputs.get("group_size") != block[1]:
            raise _field(f"{path}.input_activations.group_size", inputs.get("group_size"),
                         f"{block[1]} (the weight block's width)")
        static = False
    elif inputs.get("strategy") == "tensor" and not block:
        static = True
    else:
        raise _field(f"{path}.input_activations",
                     {k: inputs.get(k) for k in ("strategy", "dynamic")},
                     "dynamic per-token/group or static per-tensor inputs")
    kv = raw.get("kv_cache_scheme")
    if kv is not None:
        kv = _float8("kv_cache_scheme", kv)
        if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic", False):
            raise _field("kv_cache_scheme", kv, "static per-tensor FP8 scales")
    return QuantScheme(source="compressed-tensors", weights=strategy, block=block,
                       static_inputs=static, ignore=_names("ignore", raw.get("ignore")))


def _parse_modelopt(raw: dict[str, Any]) -> QuantScheme:
    fields = raw.get("quantization", raw)  # hf_quant_config.json nests them
    algo = fields.get("quant_algo")
    if algo != "FP8":
        raise _field("quant_algo", algo, "'FP8'")
    kv_algo = fields.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise _field("kv_cache_quant_algo", kv_algo, "null or 'FP8'")
    return QuantScheme(source="modelopt", weights="tensor", static_inputs=True,
                       ignore=_names("exclude_modules", fields.get("exclude_modules")))
