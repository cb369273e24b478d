"""What every engine process is told: the settings, the model folder, and what follows
from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_backend.settings import EngineSettings

# The CPU's default KV pool: this share of physical RAM (a GPU's follows kv_memory_fraction).
CPU_KV_MEMORY_FRACTION = 0.10


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    model_dir: str = ""
    # Samples a decode row may take in one step: 1 + its draft tokens with speculative
    # decoding or jump-forward (each token of a verify row is a decode row of its own).
    samples_per_row: int = 1

    @property
    def max_samples(self) -> int:
        """Samples one step may take: every running row's `samples_per_row`."""
        return self.max_running_requests * self.samples_per_row

    @property
    def device_type(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def resolve_dtype(name: str, device_type: str, checkpoint_dtype: str) -> torch.dtype:
    """"auto": float32 on CPU (the reference), the checkpoint's half type on GPU."""
    if name == "auto":
        if device_type == "cpu":
            return torch.float32
        name = checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]
