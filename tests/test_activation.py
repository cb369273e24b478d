"""The Triton SiLU-and-mul kernel against torch's `silu(gate) * up` (HF's arithmetic).

Without CUDA the kernel runs in Triton's interpreter on CPU tensors in fp32; with CUDA it runs
compiled in bf16 and fp16, where it must round exactly where torch's two kernels round.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import is_interpreted
from kernels.activation import _silu_and_mul_kernel, silu_and_mul
from minisgl_backend.layers import fast_ops
from tests.kernel_targets import cpu_mark, gpu_marks

INTERPRETED = is_interpreted(_silu_and_mul_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
TARGETS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=cpu_mark(_silu_and_mul_kernel)),
    *(pytest.param(("cuda", dtype), id=f"cuda-{name}", marks=gpu_marks(_silu_and_mul_kernel))
      for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))),
]


def _reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tokens,width", [(1, 1000), (3, 2048), (5, 96)])
def test_silu_and_mul_matches_torch(target: tuple[str, torch.dtype], tokens: int,
                                    width: int) -> None:
    """Widths that are and are not multiples of the block; a strided (sliced) input."""
    device, dtype = target
    gen = torch.Generator().manual_seed(tokens)
    wide = (torch.randn(tokens, 2 * width + 8, generator=gen) * 4).to(device=device, dtype=dtype)
    x = wide[:, : 2 * width]  # row stride != 2 * width
    out = silu_and_mul(x, block=512)
    assert out.shape == (tokens, width) and out.dtype == dtype
    expected = _reference(x)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # one rounding step apart at most (exp differs in the last fp32 bits)
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-3)
        assert (out != expected).float().mean() < 0.01


def test_silu_and_mul_of_no_tokens() -> None:
    x = torch.zeros(0, 64)
    assert silu_and_mul(x).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fast_ops_uses_the_triton_kernel_where_it_is_faster_only() -> None:
    """Wide rows with few tokens go to the Triton kernel, the rest to FlashInfer or torch: all
    agree with the reference."""
    wide, narrow = fast_ops.TRITON_SILU_MIN_WIDTH, 3072
    most = fast_ops.TRITON_SILU_MAX_TOKENS
    for tokens, width in ((1, wide), (most, wide), (most + 1, wide), (1, narrow)):
        x = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(fast_ops.silu_and_mul(x).float(), _reference(x).float(),
                                   rtol=1e-2, atol=1e-3)
