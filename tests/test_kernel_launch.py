"""`kernels.launch`: the host's cdiv and next_power_of_2 equal Triton's; `DirectLaunch` refuses
kernels it cannot launch by position; on a GPU, launches straight through the compiled
launcher compute what `kernel[grid]` computes, and a change of anything Triton specializes on
(an int's value class, a tensor's alignment or dtype, a constexpr) compiles a new variant
rather than reusing one compiled for other arguments."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kernels.launch import DirectLaunch, cdiv, next_power_of_2
from tests.kernel_targets import gpu_marks


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, (x * factor).to(out_ptr.dtype.element_ty), mask=offs < n)


def test_host_helpers_equal_tritons() -> None:
    for a in range(70):
        for b in (1, 3, 16, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def _constexpr_first(BLOCK: tl.constexpr, x_ptr):
    pass


def _with_default(x_ptr, n=4):
    pass


@pytest.mark.parametrize("fn", [_constexpr_first, _with_default])
def test_kernels_it_cannot_launch_by_position_are_refused(fn) -> None:
    with pytest.raises(ValueError, match="constexpr parameters must come last|defaults"):
        DirectLaunch(JITFunction(fn))


def test_a_launch_with_too_few_arguments_names_the_kernel() -> None:
    x = torch.zeros(4, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(TypeError, match="_scale_kernel takes 4 arguments before its constexprs"):
        DirectLaunch(_scale_kernel)((1,), x, x, 4, BLOCK=16, SQUARE=False)


def _reference(x: torch.Tensor, factor: int, square: bool) -> torch.Tensor:
    y = x.float()
    return ((y * y if square else y) * factor).to(x.dtype)


@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=gpu_marks(_scale_kernel))])
def test_direct_launches_equal_tritons_and_respecialize(_: None) -> None:
    launch = DirectLaunch(_scale_kernel)
    through_triton = []
    first_launch = launch._launch_through_triton
    launch._launch_through_triton = lambda *a: (through_triton.append(a[0]), first_launch(*a))
    base = torch.randn(4097, device="cuda").to(torch.bfloat16)
    cases = [
        (base[:4096], 3, False),  # n divisible by 16, aligned
        (base[:4096], 3, False),  # the same key again: straight through the launcher
        (base[:4095], 3, False),  # n not divisible by 16
        (base[1:4097], 3, False),  # 2 bytes off: not 16-byte aligned
        (base[:1], 1, False),  # n == 1 and factor == 1: Triton's constant ones
        (base[:4096].float(), 2, False),  # another dtype
        (base[:4096], 5, True),  # another constexpr
        (base[1:4097], 5, True),
    ]
    for i, (x, factor, square) in enumerate(cases):
        for _repeat in range(2):  # the second launch of each case takes the direct path
            out = torch.full_like(x, float("nan"))
            launch((cdiv(x.numel(), 1024),), x, out, x.numel(), factor, BLOCK=1024,
                   SQUARE=square, num_warps=4)
            torch.cuda.synchronize()
            torch.testing.assert_close(out, _reference(x, factor, square), msg=f"case {i}")
    # Each distinct key went through Triton once (the repeated case not at all); every other
    # launch took the compiled launcher.
    assert len(through_triton) == len(set(through_triton)) == len(launch._compiled) == len(cases) - 1
