"""Model architectures: one shared decoder, selected by the checkpoint's `architectures`."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl_backend.models.config import SUPPORTED_ARCHITECTURES, ModelConfig


def create_model(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """Build the model on the meta device (no memory), then load this rank's weights."""
    from minisgl_backend.models.decoder import CausalLM
    from minisgl_backend.models.weights import load_weights

    with torch.device("meta"):
        model = CausalLM(config)
    load_weights(model, model_dir, device, dtype)
    model.move_rope_to(device)
    return model.eval()


__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "create_model"]
