"""The Triton model's settings, read from its `config.pbtxt` parameters: the model folder, the
engine settings (`minisgl_backend.settings`) and the per-request limits (`RequestPolicy`),
each a parameter of its declared name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_backend.fields import Spec, spec_field, specs_of
from minisgl_backend.serving.request import RequestPolicy
from minisgl_backend.settings import from_parameters, setting_specs

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"  # relative to the repository root


def _folder(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


@dataclass(frozen=True)
class ModelFolder:
    """Which checkpoint the Triton model serves (the offline `LLM` takes it as its argument)."""

    model: str = spec_field(
        "", "custom", "a HF model folder, relative to the project root (empty: the embedded "
        f"`{DEFAULT_MODEL}`)", normalize=_folder, accepts="a folder", where="triton")


def triton_parameters() -> dict[str, tuple[Spec, Any]]:
    """Every `config.pbtxt` parameter of the `minisgl` model: name -> (spec, default)."""
    return {**specs_of(ModelFolder), **setting_specs(), **specs_of(RequestPolicy)}


def engine_parameter_names() -> list[str]:
    """Every engine setting a `config.pbtxt` may set (besides `model`)."""
    return list(setting_specs())


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
    return from_parameters(setting_specs(), parameters)


def request_policy(parameters: dict[str, str]) -> RequestPolicy:
    """The per-request limits and defaults among the parameters (unset ones keep their
    defaults)."""
    return RequestPolicy(**from_parameters(specs_of(RequestPolicy), parameters))


def load_model_config(args: dict[str, str]) -> dict[str, Any]:
    return json.loads(args["model_config"])
