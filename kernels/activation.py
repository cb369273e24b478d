"""SiLU-and-mul (the gated MLP's activation) for few tokens: grid (tokens, column blocks).

FlashInfer's kernel gives each token one thread block, so at batch 1 a single block walks the
whole intermediate row; splitting the row over column blocks spreads it over the SMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x_tok, stride_o_tok, width,
                         BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row = x_ptr + tok * stride_x_tok
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + width + cols, mask=mask, other=0.0)
    # Rounded where HF's `silu(gate) * up` rounds: after the SiLU, then after the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + tok * stride_o_tok + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_launch_silu_and_mul = DirectLaunch(_silu_and_mul_kernel)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 block: int = 1024) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] [tokens, 2 * width] -> [tokens, width]."""
    tokens, double_width = x.shape
    assert double_width % 2 == 0, f"x's last dim {double_width} is not [gate | up]"
    width = double_width // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    assert out.shape == (tokens, width) and out.stride(1) == 1
    if tokens == 0:
        return out
    _launch_silu_and_mul((tokens, cdiv(width, block)),
        x, out, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=4)
    return out
