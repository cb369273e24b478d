"""Where a test of the project's Triton kernels runs: in Triton's interpreter on CPU tensors
(where torch sees no CUDA, importing `kernels` selects it) or compiled on a GPU. The marks skip
the side that cannot run here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import is_interpreted


def cpu_mark(kernel: object) -> pytest.MarkDecorator:
    """Skips a CPU case unless `kernel` (a `@triton.jit` function) runs in the interpreter."""
    return pytest.mark.skipif(not is_interpreted(kernel), reason="CPU runs need the kernels "
                              "imported with TRITON_INTERPRET=1 (the default without CUDA)")


def gpu_marks(kernel: object) -> list[pytest.MarkDecorator]:
    """Marks a GPU case, skipped unless CUDA is there and `kernel` is compiled."""
    compiled = torch.cuda.is_available() and not is_interpreted(kernel)
    return [pytest.mark.gpu, pytest.mark.skipif(not compiled, reason="needs CUDA")]


def devices(kernel: object) -> list[Any]:
    """The two devices as test parameters: "cpu" (interpreted) and "cuda" (compiled)."""
    return [pytest.param("cpu", id="cpu", marks=cpu_mark(kernel)),
            pytest.param("cuda", id="cuda", marks=gpu_marks(kernel))]
