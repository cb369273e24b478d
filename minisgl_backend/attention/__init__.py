"""Attention backends behind one interface, created by name."""

from __future__ import annotations

import importlib.util

import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.attention.hybrid import HybridAttentionBackend
from minisgl_backend.kvcache.pool import PagedKVPool
from minisgl_backend.settings import ATTENTION_BACKENDS


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    """On a GPU in half precision: FlashInfer for prefill and the project's Triton kernels for
    decode (faster than FlashInfer's decode at the batch sizes that decode, with cheaper graph
    replays: docs/benchmarks.md), or whichever of the two is installed. Float32 has no
    FlashInfer kernels. The torch reference on CPU or without either package."""
    if device.type != "cuda":
        return "torch"
    has_flashinfer = dtype in (torch.bfloat16, torch.float16) and _importable("flashinfer")
    has_triton = _importable("triton")
    if has_flashinfer and has_triton:
        return "flashinfer,triton"
    if has_flashinfer:
        return "flashinfer"
    return "triton" if has_triton else "torch"


def create_attention_backend(name: str, kv_pool: PagedKVPool, num_heads: int, head_dim: int,
                             device: torch.device, max_pages_per_request: int = 0
                             ) -> AttentionBackend:
    """`"auto"` picks the fastest backends available on `device` (see `auto_backend`);
    `"PREFILL,DECODE"` (e.g. "flashinfer,triton") uses one backend per phase.
    `max_pages_per_request` sizes the CUDA-graph index buffers of backends that need them."""
    if name == "auto":
        name = auto_backend(device, kv_pool.dtype)
    if "," in name:
        prefill_name, decode_name = (part.strip() for part in name.split(",", 1))
        args = (kv_pool, num_heads, head_dim, device, max_pages_per_request)
        return HybridAttentionBackend(create_attention_backend(prefill_name, *args),
                                      create_attention_backend(decode_name, *args))
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
    raise ValueError(f"attention_backend must be auto, one of {', '.join(ATTENTION_BACKENDS)}, "
                     f"or PREFILL,DECODE; got {name!r}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "auto_backend", "create_attention_backend"]
