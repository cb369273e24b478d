"""The engine's own Triton kernels, one module per kernel, each with a typed Python launcher.

Compiled Triton kernels need a GPU. Where torch sees no CUDA device, importing this package
selects Triton's interpreter (`TRITON_INTERPRET=1`, unless the variable is already set), so the
kernels still run, slowly, on CPU tensors: that is how the tests check them without a GPU. The
choice is made when a kernel module is imported (Triton reads the variable as it decorates).
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` (a `@triton.jit` function) was built for Triton's interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"
