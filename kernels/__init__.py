"""The engine's own Triton kernels, one module per kernel, each with a typed Python launcher.

Importing this package does not import triton; the kernel modules do. On a machine without a GPU
the kernels run through Triton's interpreter, which is chosen when a kernel module is imported:
set `TRITON_INTERPRET=1` before importing any of them (and pass CPU tensors).
"""

from __future__ import annotations


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` (a `@triton.jit` function) was built for Triton's interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"
