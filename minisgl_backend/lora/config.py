"""Which adapters the engine serves (`lora_adapters`), and what each adapter's PEFT config says.

An adapter is a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`). It is
read strictly: a field that would make PEFT compute something the engine does not (DoRA, biases,
modules saved whole, per-module ranks, layers it cannot adapt, a rank above `max_lora_rank`)
fails naming the adapter and the field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_backend.models.config import ModelConfig
from minisgl_backend.models.projections import MODULE_BLOCK

# The projections an adapter may target, by their PEFT (HF) module names.
ADAPTABLE = tuple(MODULE_BLOCK)


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    folder: Path
    rank: int
    scale: float  # lora_alpha / rank (rsLoRA: / sqrt(rank)), folded into B at load
    targets: frozenset[str]  # of ADAPTABLE


def parse_lora_adapters(text: str) -> dict[str, Path]:
    """`name=folder,name=folder` (the `lora_adapters` setting) -> {name: folder}, in order."""
    adapters: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, folder = item.partition("=")
        name, folder = name.strip(), folder.strip()
        if not sep or not name or not folder:
            raise ValueError(f"lora_adapters: {item!r} is not `name=folder`")
        if name in adapters:
            raise ValueError(f"lora_adapters: adapter {name!r} is named twice")
        adapters[name] = Path(folder)
    return adapters


def check_lora_adapters(value: object) -> str:
    """The setting's normalizer: a string that `parse_lora_adapters` reads."""
    if not isinstance(value, str):
        raise ValueError(value)
    parse_lora_adapters(value)
    return value


def _refuse(name: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: adapter_config.json field {field!r} = {value!r} "
                      f"is not supported: {why}")


def read_adapter_config(name: str, folder: Path, max_rank: int) -> AdapterConfig:
    path = Path(folder) / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {str(folder)!r} has no adapter_config.json")
    raw = json.loads(path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, "peft_type", raw.get("peft_type"), "only LORA is implemented")
    for field, accepted, why in (
            ("use_dora", (False, None), "DoRA is not implemented"),
            ("bias", ("none", None), "adapter biases are not implemented"),
            ("modules_to_save", (None,), "modules saved whole are not implemented"),
            ("fan_in_fan_out", (False, None), "transposed (Conv1D) weights are not implemented"),
            ("layers_to_transform", (None,), "adapting some layers only is not implemented"),
            ("use_qalora", (False, None), "QA-LoRA is not implemented")):
        if raw.get(field) not in accepted and raw.get(field) != []:
            raise _refuse(name, field, raw.get(field), why)
    for field in ("rank_pattern", "alpha_pattern"):
        if raw.get(field):
            raise _refuse(name, field, raw[field], "per-module ranks are not implemented")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(name, "r", rank, "a positive integer")
    if rank > max_rank:
        raise _refuse(name, "r", rank, f"above max_lora_rank ({max_rank})")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise _refuse(name, "target_modules", targets,
                      f"a list of module names among {', '.join(ADAPTABLE)}")
    others = sorted(set(targets) - set(ADAPTABLE))
    if others:
        raise _refuse(name, "target_modules", others,
                      f"the engine adapts {', '.join(ADAPTABLE)} only")
    alpha = raw.get("lora_alpha", rank)
    scale = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return AdapterConfig(name=name, folder=Path(folder), rank=rank, scale=float(scale),
                         targets=frozenset(targets))


def read_adapter_configs(lora_adapters: str, max_rank: int) -> list[AdapterConfig]:
    """Every adapter of the `lora_adapters` setting, checked (in the setting's order)."""
    return [read_adapter_config(name, folder, max_rank)
            for name, folder in parse_lora_adapters(lora_adapters).items()]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each adaptable module of the base model."""
    hd = config.head_dim
    q, kv, hidden, inter = (config.num_heads * hd, config.num_kv_heads * hd,
                            config.hidden_size, config.intermediate_size)
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_(A|B)\.weight$")


def check_adapter_tensors(adapter: AdapterConfig, config: ModelConfig) -> None:
    """Every tensor of the adapter is an A or B of a module the engine adapts, shaped for the
    base model (`config`); ValueError naming the first that is not."""
    from safetensors import safe_open

    path = adapter.folder / "adapter_model.safetensors"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {adapter.name!r}: {str(adapter.folder)!r} has no "
                         "adapter_model.safetensors")
    shapes = projection_shapes(config)
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            match = _TENSOR.match(name)
            if match is None or match.group(3) not in adapter.targets:
                raise ValueError(f"LoRA adapter {adapter.name!r}: tensor {name!r} is not the A "
                                 f"or B of a module it targets ({', '.join(adapter.targets)})")
            layer, block, module, kind = match.groups()
            if int(layer) >= config.num_layers or (block == "mlp" and config.is_moe_layer(
                    int(layer))):
                raise ValueError(f"LoRA adapter {adapter.name!r}: tensor {name!r} adapts a "
                                 f"layer the {config.architecture} model has no such module in")
            out_features, in_features = shapes[module]
            want = (adapter.rank, in_features) if kind == "A" else (out_features, adapter.rank)
            got = tuple(handle.get_slice(name).get_shape())
            if got != want:
                raise ValueError(f"LoRA adapter {adapter.name!r}: tensor {name!r} has shape "
                                 f"{got}, the base model needs {want}")
