"""RMSNorm, with the residual add folded in (the residual is passed along like a baton)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_backend.layers.fast_ops import add_rms_norm, gemma_rms_norm, rms_norm


class RMSNorm(nn.Module):
    gemma = False  # Gemma's variant scales by (1 + weight) (`GemmaRMSNorm`)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (gemma_rms_norm if self.gemma else rms_norm)(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`; the first call passes `residual=None`.
        The inputs' memory may be reused for the outputs."""
        if residual is None:
            return self.forward(x), x
        return add_rms_norm(x, residual, self.weight, self.eps, gemma=self.gemma)


class GemmaRMSNorm(RMSNorm):
    """(1 + weight) * x / rms(x), computed in float32 (Gemma 3)."""

    gemma = True
