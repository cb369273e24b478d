"""FP8 (e4m3) activations and the block-scaled W8A8 GEMM.

`quantize_activations` quantizes x [M, K] as `minisgl_backend.quantization.fp8.quantize_input`
does, bit for bit: per token, per token and column group, or with a static scale. Rounding to
e4m3 is done in float32 here (`round_to_e4m3`, nearest, ties to even) so that the final cast
is exact: the GPU's cast rounds the same way, but Triton's interpreter truncates and carries
wrongly, and the same arithmetic has to hold on both.

`block_scaled_matmul` is the GEMM of FP8 inputs with a scale per block of the weight (as
DeepSeek-V3's 128 x 128 blocks): `tl.dot` of e4m3 tiles, BLOCK_K = the block's width, each K
step's float32 product scaled by its input and weight scales before it is added. Scales that
do not change along K (per token, per output channel, static) are the same kernel with one
scale column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2
from minisgl_backend.quantization.fp8 import FP8, FP8_MAX, MIN_SCALE

E4M3_MAX = tl.constexpr(FP8_MAX)
SCALE_FLOOR = tl.constexpr(MIN_SCALE)
# Below e4m3's smallest normal (2^-6) the values are multiples of 2^-9 (subnormals).
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
E4M3_SUBNORMAL = tl.constexpr(2.0**-9)
E4M3_SUBNORMALS_PER_UNIT = tl.constexpr(2.0**9)
# Adding 1.5 * 2^23 to a float32 of magnitude < 2^22 rounds it to an integer (ties to even).
ROUNDING_SHIFT = tl.constexpr(1.5 * 2.0**23)
QUANT_BLOCK = 1024  # columns a quantization program handles per loop step


@triton.jit
def round_to_e4m3(v):
    """float32 v, |v| <= 448, rounded to the nearest e4m3 value (ties to even), as float32."""
    bits = v.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of float32's 23 mantissa bits, rounding at bit 19 (carries into
    # the exponent are right by construction).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = tl.abs(v)
    steps = (magnitude * E4M3_SUBNORMALS_PER_UNIT + ROUNDING_SHIFT) - ROUNDING_SHIFT
    sign = (bits >> 31) << 31  # an arithmetic shift: the sign bit alone, int32
    subnormal = (steps * E4M3_SUBNORMAL).to(tl.int32, bitcast=True) | sign
    return tl.where(magnitude < E4M3_MIN_NORMAL, subnormal.to(tl.float32, bitcast=True), normal)


@triton.jit
def saturate_e4m3(x, scale):
    """`x / scale` clamped to +-448 and cast to e4m3 (`fp8.saturate`, bit for bit)."""
    v = tl.div_rn(x.to(tl.float32), scale)
    v = tl.minimum(tl.maximum(v, -E4M3_MAX), E4M3_MAX)
    return round_to_e4m3(v).to(tl.float8e4nv)


@triton.jit
def dynamic_scale(amax):
    """amax / 448, at least the scale floor (`fp8.dynamic_scale`)."""
    return tl.maximum(tl.div_rn(amax, E4M3_MAX), SCALE_FLOOR)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, K, stride_xm, stride_qm,
                     stride_sm, SEGMENT: tl.constexpr, STATIC: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """Program (row, segment) quantizes x[row, segment's columns]; dynamically, with the
    segment's amax (a segment is a column group, or the whole row)."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * SEGMENT
    end = tl.minimum(start + SEGMENT, K)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = dynamic_scale(tl.max(amax, 0))
        tl.store(scale_ptr + row * stride_sm + tl.program_id(1), scale)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < end, other=0.0)
        tl.store(q_ptr + row * stride_qm + k, saturate_e4m3(x, scale), mask=k < end)


_launch_quantize = DirectLaunch(_quantize_kernel)


def quantize_activations(x: torch.Tensor, group: int = 0,
                         input_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q e4m3 [M, K], scale float32): per token (group 0, or group >= K: scale
    [M, 1]), per token and `group` columns (scale [M, ceil(K / group)]), or with the static
    `input_scale` (1 element; returned as [1, 1]). The values of `fp8.quantize_input`."""
    rows, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    static = input_scale is not None
    segment = group if group and group < k and not static else k
    if static:
        scale = input_scale.float().reshape(1, 1)
        segment = min(k, QUANT_BLOCK)  # no amax: split the row for more programs
    else:
        scale = torch.empty((rows, cdiv(k, segment)), dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return q, scale
    _launch_quantize((rows, cdiv(k, segment)), x, q, scale, scale, k, x.stride(0), q.stride(0),
                     scale.stride(0), SEGMENT=segment, STATIC=static,
                     BLOCK_K=min(QUANT_BLOCK, next_power_of_2(segment)))
    return q, scale


@triton.jit
def _block_scaled_matmul_kernel(
        a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K,
        stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SWIZZLE: tl.constexpr):
    """c = (a * a_scale) @ (b * b_scale).T for a [M, K], b [N, K] in e4m3; a's scale is
    a_scale[m, k // GROUP_K], b's b_scale[n // GROUP_N, k // GROUP_K] (GROUP_K a multiple of
    BLOCK_K, so one scale per row and K step)."""
    pid = tl.program_id(0)
    # Programs in a row of SWIZZLE M tiles share B tiles in L2 while they run.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = SWIZZLE * tiles_n
    first_m = (pid // per_group) * SWIZZLE
    group_rows = tl.minimum(tiles_m - first_m, SWIZZLE)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + m[:, None].to(tl.int64) * stride_am + k[None, :]
    b_ptrs = b_ptr + n[None, :].to(tl.int64) * stride_bn + k[:, None]  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + m * stride_asm
    b_scale_ptrs = b_scale_ptr + (n // GROUP_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + (k0 // GROUP_K) * stride_ask, mask=m_mask, other=0.0)
        b_scale = tl.load(b_scale_ptrs + (k0 // GROUP_K) * stride_bsk, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + m[:, None].to(tl.int64) * stride_cm + n[None, :], c,
             mask=m_mask[:, None] & n_mask[None, :])


_launch_block_matmul = DirectLaunch(_block_scaled_matmul_kernel)


@dataclass(frozen=True)
class MatmulTiles:
    """How `block_scaled_matmul` tiles the output; `matmul_tiles` picks the defaults."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    swizzle: int = 8


def matmul_tiles(rows: int) -> MatmulTiles:
    """Small M tiles for few rows (more programs to stream the weight), big ones for prefill."""
    if rows <= 32:
        return MatmulTiles(block_m=max(16, next_power_of_2(rows)), block_n=64)
    if rows <= 256:
        return MatmulTiles(block_m=64, block_n=128)
    return MatmulTiles(block_m=128, block_n=128, num_warps=8)


MAX_BLOCK_K = 128  # the widest K step: e4m3 tiles of 128-byte rows


def _scale_view(scale: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """A scale [rows or 1, groups or 1] (or one element) as [rows, groups] (zero strides
    where it is broadcast)."""
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
    assert scale.dim() == 2 and scale.dtype == torch.float32, \
        f"scales are float32 [rows, groups], got {scale.dtype} {tuple(scale.shape)}"
    return scale.expand(rows, groups)


def block_scaled_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                        w_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None, tiles: MatmulTiles | None = None
                        ) -> torch.Tensor:
    """`dequantize(x_q, x_scale) @ dequantize(w_q, w_scale, block).T (+ bias)` -> [M, N].

    x_q [M, K], w_q [N, K] e4m3 with unit last strides; w_scale [ceil(N / bn), ceil(K / bk)]
    for `block` = (bn, bk); x_scale [M, ceil(K / bk)], [M, 1] (per token) or one element.
    A weight scaled per output channel is block (1, K) with w_scale [N, 1]. bk is a power of
    two >= 32 unless both scales have one column.
    """
    rows, k = x_q.shape
    n = w_q.shape[0]
    bn, bk = block
    assert w_q.shape[1] == k, f"x {tuple(x_q.shape)} does not fit weight {tuple(w_q.shape)}"
    assert x_q.dtype == FP8 and w_q.dtype == FP8, "x_q and w_q are float8_e4m3fn"
    assert x_q.stride(1) == 1 and w_q.stride(1) == 1, "x_q and w_q need unit last strides"
    groups = cdiv(k, bk)
    x_scale = _scale_view(x_scale, rows, x_scale.shape[-1] if x_scale.numel() > 1 else 1)
    w_scale = _scale_view(w_scale, cdiv(n, bn), w_scale.shape[-1] if w_scale.numel() > 1 else 1)
    assert x_scale.shape[1] in (1, groups) and w_scale.shape[1] in (1, groups), \
        f"scales {tuple(x_scale.shape)}, {tuple(w_scale.shape)} do not fit block {block}"
    one_column = x_scale.shape[1] == 1 and w_scale.shape[1] == 1
    if one_column:
        block_k, group_k = MAX_BLOCK_K, MAX_BLOCK_K
    else:
        assert bk >= 32 and bk & (bk - 1) == 0, f"block width {bk} is not a power of 2 >= 32"
        block_k, group_k = min(bk, MAX_BLOCK_K), bk
    out = torch.empty((rows, n), dtype=out_dtype, device=x_q.device)
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1
    if rows == 0:
        return out
    tiles = tiles or matmul_tiles(rows)
    grid = (cdiv(rows, tiles.block_m) * cdiv(n, tiles.block_n),)
    _launch_block_matmul(
        grid, x_q, w_q, out, x_scale, w_scale, out if bias is None else bias, rows, n, k,
        x_q.stride(0), w_q.stride(0), out.stride(0), x_scale.stride(0),
        x_scale.stride(1) if x_scale.shape[1] > 1 else 0, w_scale.stride(0),
        w_scale.stride(1) if w_scale.shape[1] > 1 else 0,
        GROUP_N=bn, GROUP_K=group_k, HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=block_k, SWIZZLE=tiles.swizzle,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
