"""Model architectures: one shared decoder, selected by the checkpoint's `architectures`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from minisgl_backend.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

LOAD_FORMATS = ("auto", "dummy")

logger = logging.getLogger(__name__)


def create_model(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
    *, load_format: str = "auto", quantization: str = "auto",
) -> torch.nn.Module:
    """Build the model on the meta device (no memory), then fill this rank's weights.

    `load_format="auto"` reads them from the checkpoint in `model_dir`; "dummy" opens no file
    and fills them with seeded random values on `device` (benchmarks of real shapes).
    `quantization`: "auto" follows the checkpoint's `quantization_config`; "fp8" quantizes a
    full-precision one at load (`quantization/config.py`). The scheme is `model.quant_scheme`.
    """
    from minisgl_backend.models.decoder import CausalLM
    from minisgl_backend.quantization.config import resolve_scheme
    from minisgl_backend.quantization.model import quantize_model

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    scheme = resolve_scheme(model_dir, quantization)
    with torch.device("meta"):
        model = CausalLM(config)
    if scheme is not None:
        quantize_model(model, scheme)
    model.quant_scheme = scheme
    if load_format == "dummy":
        from minisgl_backend.models.dummy import fill_dummy_weights

        fill_dummy_weights(model, device, dtype)
    else:
        from minisgl_backend.models.weights import load_weights

        load_weights(model, model_dir, device, dtype, scheme)
    model.move_rope_to(device)
    logger.info("%s loaded: %s, %.1f MiB of weights on this rank", config.architecture,
                scheme.describe() if scheme else f"{dtype} weights", weight_bytes(model) / 2**20)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters (FP8 weights count one byte each)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["LOAD_FORMATS", "SUPPORTED_ARCHITECTURES", "ModelConfig", "create_model",
           "weight_bytes"]
