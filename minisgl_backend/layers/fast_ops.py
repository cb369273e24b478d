"""Fused element-wise operations: FlashInfer kernels on a GPU in half precision (and the
project's Triton SiLU-and-mul for wide rows and few tokens), torch otherwise.

The torch versions are the reference arithmetic (HF transformers'); float32 and CPU always use
them, so the float32 oracle tests compare like with like. Each FlashInfer kernel replaces
several small torch kernels, which matters most inside decode CUDA graphs at small batch.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from types import ModuleType

import torch
import torch.nn.functional as F

HALF_TYPES = (torch.bfloat16, torch.float16)


@lru_cache(maxsize=None)
def flashinfer_module() -> ModuleType | None:
    if importlib.util.find_spec("flashinfer") is None:
        return None
    import flashinfer

    return flashinfer


@lru_cache(maxsize=None)
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton_kernels(x: torch.Tensor) -> bool:
    """The project's own Triton kernels (`kernels/`) run compiled on a GPU."""
    return x.is_cuda and has_triton()


def use_flashinfer(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in HALF_TYPES and flashinfer_module() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, for x [tokens, size] or [tokens, heads, size]."""
    if use_flashinfer(x):
        return flashinfer_module().norm.rmsnorm(x.contiguous(), weight, eps)
    return weight * _normalized(x, eps).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: (1 + weight) * x / rms(x), all in float32, cast once (HF's order), for
    x [tokens, size] or [tokens, heads, size] (FlashInfer's Gemma norm takes 2-D input only)."""
    if use_flashinfer(x):
        rows = x.reshape(-1, x.shape[-1])
        return flashinfer_module().norm.gemma_rmsnorm(rows.contiguous(), weight, eps).view(
            x.shape)
    return (_normalized(x, eps) * (1.0 + weight.float())).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` (`gemma`: `gemma_rms_norm`); may reuse the
    memory of both inputs."""
    if use_flashinfer(x) and x.is_contiguous() and residual.is_contiguous():
        norm = flashinfer_module().norm
        fused = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
        fused(x, residual, weight, eps)  # in place
        return x, residual
    summed = x + residual
    return (gemma_rms_norm if gemma else rms_norm)(summed, weight, eps), summed


# Where the project's column-split Triton kernel beats FlashInfer's one block per token: wide
# rows (Llama-3.1-8B's 14,336 columns), few tokens. On narrow rows (Qwen3-0.6B's 3,072) one
# block per token already fills the device, and FlashInfer is as fast or faster.
TRITON_SILU_MIN_WIDTH = 8192
TRITON_SILU_MAX_TOKENS = 256


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    if x.dtype in HALF_TYPES and x.dim() == 2 and x.shape[0] <= TRITON_SILU_MAX_TOKENS \
            and x.shape[1] >= 2 * TRITON_SILU_MIN_WIDTH and use_triton_kernels(x):
        from kernels.activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    if use_flashinfer(x):
        return flashinfer_module().activation.silu_and_mul(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] along the last dim (Gemma's MLP)."""
    if use_flashinfer(x):
        return flashinfer_module().activation.gelu_tanh_and_mul(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
