"""FP8 (e4m3) arithmetic: the reference every FP8 path of the engine computes.

A quantized tensor is `q * scale`, q in float8_e4m3fn. Scales come in three shapes:

- per tensor: one float;
- per row (a weight's output channel, an activation's token): `[rows, 1]`, or for an activation
  quantized per token and column group, `[rows, cols / group]`;
- per block of a weight: `[ceil(N / bn), ceil(K / bk)]`, one scale per `bn x bk` tile.

Dynamic quantization picks each scale as amax / 448 (the largest e4m3 value), so the largest
element maps to 448; static quantization divides by a given scale and saturates. The linear
layer's product is `dequantize(x_q) @ dequantize(w_q).T` in float32, cast to x's dtype; the GPU
kernels (`kernels/fp8_gemm.py`, `kernels/fp8_gemv.py`) compute the same sums in another order.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The smallest dynamic scale: an all-zero row or group still divides by something finite.
MIN_SCALE = 1e-12


def saturate(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`x / scale`, clamped to e4m3's range and rounded to e4m3 (static quantization)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dynamic_scale(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """amax / 448 along `dim` (kept), float32."""
    amax = x.float().abs().amax(dim=dim, keepdim=True)
    return (amax / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_per_token(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K], scale [M, 1]); with `group`, one scale per token and group of
    `group` columns: scale [M, ceil(K / group)] (the last group may be narrower)."""
    if not group or group >= x.shape[-1]:
        scale = dynamic_scale(x)
        return saturate(x, scale), scale
    m, k = x.shape
    pad = -k % group
    padded = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, group)
    scale = dynamic_scale(padded)  # [M, groups, 1]
    q = saturate(padded, scale).view(m, -1)[:, :k]
    return q, scale.squeeze(-1)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] quantized per output channel: (q [N, K], scale [N, 1])."""
    return quantize_per_token(w)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] quantized per `block` tile: (q [N, K], scale [ceil(N/bn), ceil(K/bk)])."""
    bn, bk = block
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = saturate(tiles, scale).view(padded.shape)[:n, :k]
    return q, scale[:, 0, :, 0].contiguous()


def expand_scale(scale: torch.Tensor, rows: int, cols: int,
                 block: tuple[int, int] | None = None) -> torch.Tensor:
    """A scale of any shape above, broadcast to [rows, cols] (float32). `block`: the tile of a
    block scale, or (1, group) for an activation's per token and column group scale."""
    scale = scale.float()
    if block is not None:
        bn, bk = block
        return scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    return scale.reshape(-1, 1).expand(rows, cols)


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 values of `q` [rows, cols] under `scale` (any of the shapes above)."""
    return q.float() * expand_scale(scale, q.shape[0], q.shape[1], block)


def quantize_input(x: torch.Tensor, *, group: int = 0,
                   input_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 layer's input x [M, K] quantized as the layer's scheme says: with the static
    `input_scale` (one float), else dynamically per token (`group`: per token and column group)."""
    if input_scale is not None:
        return saturate(x, input_scale), input_scale.float().reshape(1, 1)
    return quantize_per_token(x, group)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                     block: tuple[int, int] | None = None,
                     input_scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` for an FP8 weight: x [..., K] quantized (`quantize_input`; per column
    group of the block's width for block-scaled weights), both sides dequantized to float32,
    multiplied, cast to x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    group = block[1] if block else 0
    q, scale = quantize_input(rows, group=group, input_scale=input_scale)
    x_block = (1, group) if group and input_scale is None else None
    out = dequantize(q, scale, x_block) @ dequantize(weight, weight_scale, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
