"""Launching the project's Triton kernels for less host time.

In Triton 3.6, `kernel[grid](*args)` spends host time on every launch before the compiled
kernel's launcher runs: binding and specializing every argument, building the cache key,
checking the kernel's globals; several times what the launcher itself takes. A decode step that
samples with every control launches six such kernels outside the CUDA graph, and a small
model's step cannot spare that. `DirectLaunch` calls the launcher straight once Triton has
compiled the kernel for a key that fixes what Triton specializes on. `cdiv` and
`next_power_of_2` are the host's: Triton's are constexpr functions, slow to call on the host.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver

from kernels import is_interpreted

MAX_KEYS = 1024  # compiled kernels kept per launcher (many shapes in a row: start over)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


class DirectLaunch:
    """`launch(grid, *args, **meta)` does what `kernel[grid](*args, **meta)` does. The first
    launch of a key goes through Triton (compiling if needed); later ones call the compiled
    kernel's launcher. The key holds everything Triton's specialization reads: the int
    arguments' values, the tensors' dtypes and alignment, the device (of the first argument, a
    tensor) and `meta` (constexprs and options such as num_warps). `args` are the kernel's
    parameters up to its constexprs, in order; the constexprs come by name in `meta`. Under
    the interpreter (TRITON_INTERPRET=1) and while a launch hook is set (a profiler), every
    launch goes through Triton."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # The interpreter's kernels (TRITON_INTERPRET=1) are launched through Triton.
        self.compiles = not is_interpreted(kernel)
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.constexprs = tuple(p.name for p in params if "constexpr" in str(p.annotation))
        self.num_args = len(params) - len(self.constexprs)
        name = kernel.fn.__name__
        if any(p.name in self.constexprs for p in params[: self.num_args]):
            raise ValueError(f"{name}: constexpr parameters must come last")
        if any(p.default is not inspect.Parameter.empty for p in params):
            raise ValueError(f"{name}: parameters with defaults are not supported")
        self._compiled: dict[tuple, tuple[CompiledKernel, tuple]] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        if len(args) != self.num_args:
            raise TypeError(f"{self.kernel.fn.__name__} takes {self.num_args} arguments "
                            f"before its constexprs, got {len(args)}")
        if not self.compiles:
            self.kernel[grid](*args, **meta)
            return
        # What Triton specializes on: an int's value (1, a multiple of 16, its width), a
        # tensor's dtype and 16-byte alignment, a float never (its type stands for it). One
        # expression, no call per argument: this key is most of a direct launch's host time.
        device = args[0].get_device() if isinstance(args[0], torch.Tensor) else None
        key = (device, tuple(meta.items()), tuple([
            a if type(a) is int else (a.dtype, a.data_ptr() & 15 == 0)
            if isinstance(a, torch.Tensor) else float if type(a) is float else a
            for a in args]))
        found = self._compiled.get(key)
        if found is None or _hooked():
            self._launch_through_triton(key, grid, args, meta)
            return
        compiled, constants = found
        stream = _current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *constants)

    def _launch_through_triton(self, key: tuple, grid: tuple[int, ...], args: tuple,
                               meta: dict[str, Any]) -> None:
        compiled = self.kernel[grid](*args, **meta)
        if not isinstance(compiled, CompiledKernel) or key[0] is None:
            return  # the interpreter, or no tensor first to tell the device by
        if len(self._compiled) >= MAX_KEYS:
            self._compiled.clear()
        self._compiled[key] = (compiled, tuple(meta[name] for name in self.constexprs))


def _current_stream(device: int) -> int:
    """The device's current stream (torch's, which Triton launches on) as a raw handle."""
    return driver.active.get_current_stream(device)


def _hooked() -> bool:
    """A launch hook is set (Triton 3.6 keeps a chain of them; earlier versions one or None)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))
