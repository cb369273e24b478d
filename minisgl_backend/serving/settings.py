"""Engine settings of a Triton model, read from its `config.pbtxt` parameters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from minisgl_backend.fields import specs_of
from minisgl_backend.serving.request import RequestPolicy
from minisgl_backend.speculative import SpeculativeConfig

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"  # relative to the repository root

# parameter key -> (LLM keyword, type)
_ENGINE_PARAMETERS: dict[str, tuple[str, type | str]] = {
    "tp_size": ("tp_size", int),
    "page_size": ("page_size", int),
    "max_running_requests": ("max_running_requests", int),
    "chunked_prefill_size": ("chunked_prefill_size", int),
    "max_total_tokens": ("max_total_tokens", int),
    "kv_memory_fraction": ("kv_memory_fraction", float),
    "cache": ("cache", str),
    "device": ("device", str),
    "dtype": ("dtype", str),
    "attention_backend": ("attention_backend", str),
    "cuda_graph_max_bs": ("cuda_graph_max_bs", int),
    "overlap": ("overlap", "bool"),
    "fused_gemv_max_bs": ("fused_gemv_max_bs", int),
    "mixed_prefill": ("mixed_prefill", "bool"),
    "jump_forward": ("jump_forward", "bool"),
    "grammar_workers": ("grammar_workers", int),
    "load_format": ("load_format", str),
    # Speculative decoding: SpeculativeConfig's fields, parameters of the same names.
    **{name: (name, {"int": int, "float": float}.get(spec.kind, str))
       for name, (spec, _) in specs_of(SpeculativeConfig).items()},
}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def engine_parameter_names() -> list[str]:
    """Every engine setting a `config.pbtxt` may set (besides `model`)."""
    return list(_ENGINE_PARAMETERS)


def model_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """`parameters { key: ... value: { string_value: ... } }` as a plain dict."""
    raw = model_config.get("parameters") or {}
    return {key: str(value.get("string_value", "")) for key, value in raw.items()}


def resolve_model_dir(parameters: dict[str, str], model_repository: str) -> Path:
    """The `model` parameter (a folder; relative paths are relative to the project root, the
    folder that holds `model_repository/`), defaulting to the embedded model."""
    root = Path(model_repository).resolve().parents[1]
    path = Path(parameters.get("model") or DEFAULT_MODEL)
    return path if path.is_absolute() else root / path


def engine_settings(parameters: dict[str, str]) -> dict[str, Any]:
    """LLM keyword arguments from the parameters that are set (empty values are skipped)."""
    settings: dict[str, Any] = {}
    for key, (name, kind) in _ENGINE_PARAMETERS.items():
        value = parameters.get(key, "").strip()
        if not value:
            continue
        if kind == "bool":
            settings[name] = _bool(key, value)
            continue
        try:
            settings[name] = kind(value)
        except ValueError:
            raise ValueError(f"parameter {key} must be {kind.__name__}, got {value!r}") from None
    return settings


def request_policy(parameters: dict[str, str]) -> RequestPolicy:
    """The per-request limits and defaults among the parameters (each field of
    `RequestPolicy` is a parameter of its name; unset ones keep their defaults)."""
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(RequestPolicy):
        value = parameters.get(spec.name, "").strip()
        if not value:
            continue
        if spec.type == "bool":
            values[spec.name] = _bool(spec.name, value)
            continue
        try:
            values[spec.name] = int(value)
        except ValueError:
            raise ValueError(f"parameter {spec.name} must be int, got {value!r}") from None
        if values[spec.name] < 0:
            raise ValueError(f"parameter {spec.name} must be >= 0, got {value!r}")
    return RequestPolicy(**values)


def _bool(key: str, value: str) -> bool:
    if value.lower() not in _BOOLS:
        raise ValueError(f"parameter {key} must be true or false, got {value!r}")
    return _BOOLS[value.lower()]


def load_model_config(args: dict[str, str]) -> dict[str, Any]:
    return json.loads(args["model_config"])
