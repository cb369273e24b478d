"""Engine settings of a Triton model, read from its `config.pbtxt` parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minisgl_backend.serving.request import RequestLimits

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
    "load_format": ("load_format", str),
}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


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
            if value.lower() not in _BOOLS:
                raise ValueError(f"parameter {key} must be true or false, got {value!r}")
            settings[name] = _BOOLS[value.lower()]
            continue
        try:
            settings[name] = kind(value)
        except ValueError:
            raise ValueError(f"parameter {key} must be {kind.__name__}, got {value!r}") from None
    return settings


_LIMIT_PARAMETERS = ("max_input_bytes", "max_prompt_tokens", "max_output_tokens",
                     "max_stop_words", "max_stop_word_length")


def request_limits(parameters: dict[str, str]) -> RequestLimits:
    """The per-request limits among the parameters (unset ones keep their defaults)."""
    values = {}
    for key in _LIMIT_PARAMETERS:
        value = parameters.get(key, "").strip()
        if not value:
            continue
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"parameter {key} must be int, got {value!r}") from None
        if values[key] < 0:
            raise ValueError(f"parameter {key} must be >= 0, got {value!r}")
    return RequestLimits(**values)


def load_model_config(args: dict[str, str]) -> dict[str, Any]:
    return json.loads(args["model_config"])
