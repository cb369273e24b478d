"""The FP8 linear layer's product, on the path that suits the device and the number of rows.

Every path computes `fp8.reference_linear`: the same quantized inputs, float32 sums in another
order. On CUDA, without host syncs (a decode step runs in a CUDA graph):

- up to 16 rows (decode): `fp8_gemv`, bound by the weight reads, which e4m3 halves;
- weights per output channel: x quantized by `quantize_activations`, then cuBLASLt's rowwise
  scaled GEMM (`torch._scaled_mm`) where its constraints hold (bf16 out, K and N multiples of
  16), else the Triton GEMM with one scale column;
- weights per block: `quantize_activations` per token and block width, `block_scaled_matmul`.

On CPU, and for float32 inputs (no FP8 tensor-core path keeps float32's precision), the
reference itself.
"""

from __future__ import annotations

import torch

from kernels.fp8_gemm import block_scaled_matmul, quantize_activations
from kernels.fp8_gemv import MAX_ROWS, fp8_gemv
from minisgl_backend.quantization.fp8 import reference_linear

SCALED_MM_ALIGN = 16  # cuBLASLt's FP8 GEMM: K and N multiples of 16


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` for an FP8 weight, x [..., K] -> [..., N] in x's dtype: weight [N, K]
    float8_e4m3fn, weight_scale float32 per output channel [N, 1] or, with `block` (bn, bk),
    per block [ceil(N / bn), ceil(K / bk)]; input_scale: the static input scale (one float),
    else x is quantized per token (and per bk columns with blocks)."""
    if x.device.type != "cuda" or x.dtype == torch.float32:
        return reference_linear(x, weight, weight_scale, block=block, input_scale=input_scale,
                                bias=bias)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    if rows.shape[0] <= MAX_ROWS:
        out = fp8_gemv(rows, weight, weight_scale, block=block, input_scale=input_scale,
                       bias=bias)
    elif block is None:
        out = _per_channel_matmul(rows, weight, weight_scale, input_scale, bias)
    else:
        x_q, x_scale = quantize_activations(rows, block[1], input_scale)
        out = block_scaled_matmul(x_q, x_scale, weight, weight_scale, block, x.dtype, bias)
    return out.reshape(*x.shape[:-1], n)


def _per_channel_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        input_scale: torch.Tensor | None, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """x [M, K] times a weight scaled per output channel (or per tensor)."""
    rows, n = x.shape[0], weight.shape[0]
    x_q, x_scale = quantize_activations(x, 0, input_scale)
    w_scale = weight_scale.float().reshape(-1, 1).expand(n, 1)
    if not _fits_scaled_mm(x.dtype, weight):
        return block_scaled_matmul(x_q, x_scale, weight, w_scale, (1, weight.shape[1]),
                                   x.dtype, bias)
    return torch._scaled_mm(
        x_q, weight.t(), scale_a=x_scale.expand(rows, 1).contiguous(),
        scale_b=w_scale.reshape(1, n).contiguous(), out_dtype=x.dtype,
        bias=None if bias is None else bias.to(x.dtype))


def _fits_scaled_mm(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Rowwise-scaled `torch._scaled_mm`: bf16 out, K and N multiples of 16, a weight whose
    transpose is column-major."""
    n, k = weight.shape
    return (dtype == torch.bfloat16 and n % SCALED_MM_ALIGN == 0 and k % SCALED_MM_ALIGN == 0
            and weight.stride() == (k, 1))
