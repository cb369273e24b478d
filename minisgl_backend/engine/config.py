"""Engine settings shared by the scheduler and every engine process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FUSED_GEMV_MAX_BS = 16  # rows the few-rows GEMV kernel takes (kernels/gemv.py MAX_ROWS)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    tp_size: int = 1
    page_size: int = 1
    max_running_requests: int = 256
    max_total_tokens: int | None = None  # KV pool size in tokens; None: fit the device
    device: str = "auto"  # "auto", "cpu" or "cuda"
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    attention_backend: str = "auto"
    kv_memory_fraction: float = 0.85  # GPU: share of free memory the weights + KV may take
    cpu_kv_memory_fraction: float = 0.10  # CPU default pool: share of physical RAM
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random, config only
    # Decode batches up to this size replay CUDA graphs (GPU only); 0 turns graphs off.
    cuda_graph_max_bs: int = 256
    overlap: bool = True  # GPU: prepare and launch step N+1 while step N runs
    # GPU, tp_size 1: decode batches up to this size run fused few-rows GEMVs; 0: off.
    fused_gemv_max_bs: int = 2
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
