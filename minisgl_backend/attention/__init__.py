"""Attention backends behind one interface, created by name."""

from __future__ import annotations

import importlib.util

import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.kvcache.pool import PagedKVPool

ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    """FlashInfer on a GPU for half types, else the project's Triton kernels; the torch
    reference on CPU (or without either package)."""
    if device.type != "cuda":
        return "torch"
    if dtype in (torch.bfloat16, torch.float16) and _importable("flashinfer"):
        return "flashinfer"
    return "triton" if _importable("triton") else "torch"


def create_attention_backend(
    name: str, kv_pool: PagedKVPool, num_heads: int, head_dim: int, device: torch.device,
    max_pages_per_request: int = 0,
) -> AttentionBackend:
    """`"auto"` picks the fastest backend available on `device` (see `auto_backend`).
    `max_pages_per_request` sizes the CUDA-graph index buffers of backends that need them."""
    if name == "auto":
        name = auto_backend(device, kv_pool.buffer.dtype)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device")
        from minisgl_backend.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(kv_pool, num_heads, head_dim, device,
                                          max(1, max_pages_per_request))
    if name == "torch":
        from minisgl_backend.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, num_heads, head_dim)
    if name == "triton":
        from minisgl_backend.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, num_heads, head_dim)
    raise ValueError(f"attention_backend must be one of auto, {', '.join(ATTENTION_BACKENDS)}; "
                     f"got {name!r}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "auto_backend", "create_attention_backend"]
