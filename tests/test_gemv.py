"""The few-rows GEMV kernel (with its optional RMSNorm / SiLU-and-mul prologue and residual
epilogue) against the torch ops it replaces.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors in fp32 (the interpreter's
half-precision `tl.dot` is not usable); with CUDA it runs compiled in bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import is_interpreted
from kernels.gemv import _gemv_kernel, fused_gemv

INTERPRETED = is_interpreted(_gemv_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
# The interpreter trips numpy's deprecation of int() on 1-element arrays at every loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
EPS = 1e-5
TARGETS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU runs need the kernels imported with TRITON_INTERPRET=1")),
    *(pytest.param(("cuda", dtype), id=f"cuda-{name}", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="needs CUDA")]) for name, dtype in (("bf16", torch.bfloat16),
                                                              ("fp16", torch.float16))),
]
VARIANTS = ["plain", "norm", "gated", "residual", "norm+residual"]


def _reference(variant: str, x: torch.Tensor, weight: torch.Tensor, norm_w: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
    """The torch ops of the layer, computed in float32 from the same inputs, rounded where the
    layer rounds (to the weight's dtype)."""
    dtype = weight.dtype
    if variant.startswith("norm"):
        x32 = x.float()
        x = norm_w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
                              ).to(dtype).float()
        x = x.to(dtype)
    elif variant == "gated":
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate).to(dtype).float() * up).to(dtype)
    y = F.linear(x.float(), weight.float()).to(dtype)
    if variant.endswith("residual"):
        y = (y.float() + residual.float()).to(dtype)
    return y


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,use_dot", [(1, True), (3, True), (16, True), (1, False),
                                          (3, False)])
def test_matches_torch(target: tuple[str, torch.dtype], variant: str, rows: int,
                       use_dot: bool) -> None:
    """N and K that are not multiples of the blocks; a strided x; both ways to multiply."""
    device, dtype = target
    n, k = (40, 96) if device == "cpu" else (1000, 1500)
    gen = torch.Generator().manual_seed(rows)
    width = 2 * k if variant == "gated" else k
    wide = torch.randn(rows, width + 8, generator=gen).to(device=device, dtype=dtype)
    x = wide[:, :width]
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(device=device, dtype=dtype)
    residual = torch.randn(rows, n, generator=gen).to(device=device, dtype=dtype)
    out = fused_gemv(
        x, weight, norm_weight=norm_w if variant.startswith("norm") else None, eps=EPS,
        gated=variant == "gated", residual=residual if variant.endswith("residual") else None,
        block_n=16, block_k=32 if device == "cpu" else 256, use_dot=use_dot)
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = _reference(variant, x, weight, norm_w, residual)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_rejects_what_it_cannot_do() -> None:
    weight = torch.zeros(32, 16)
    with pytest.raises(AssertionError, match="1 to 16 rows"):
        fused_gemv(torch.zeros(17, 16), weight)
    with pytest.raises(AssertionError, match="does not fit"):
        fused_gemv(torch.zeros(2, 16), weight, gated=True)
    with pytest.raises(AssertionError, match="do not combine"):
        fused_gemv(torch.zeros(2, 32), weight, gated=True, norm_weight=torch.ones(16))
