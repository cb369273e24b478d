"""Matrix-vector products for a few rows (batch-1 to batch-16 decode), with the layer's small
neighbours folded in.

At batch 1 a decoder layer reads its weights once per token, and the kernels between its
GEMVs (add + RMSNorm, SiLU-and-mul) are tiny but each costs a launch and a gap in the CUDA
graph. Here one kernel computes `out = x' @ weight.T` for x [M <= 16, K], where x' is, optionally,

- `rms_norm(x) * norm_weight` (the layer's input / post-attention norm: each program sums the
  squares of the x slices it reads anyway, and scales its results by 1/RMS at the end), or
- `silu(gate) * up` for x = [gate | up] [M, 2K] (the MLP's activation),

and adds, optionally, `residual` to the result (the residual connection after o_proj and
down_proj). Rounding is HF transformers' where the order allows: SiLU's result is rounded to
the dtype before the product with `up`, the product before the GEMV, the GEMV's result before
the residual add; with the norm, `x * norm_weight` is rounded before the GEMV and 1/RMS applied
to its float32 result (HF rounds `x / RMS` first: the same size of rounding error, one pass
over x fewer, so the weight reads start at once). Programs split N into blocks of `block_n`
rows of the weight and loop over K. Two ways to multiply: `tl.dot` with the few rows of x
padded to 16 (the GEMV is bound by weight reads, so unused MMA lanes cost nothing), or
(`use_dot=False`, for up to four rows) products accumulated element-wise on the CUDA cores and
summed across K once at the end.

The decoder takes this path where it beats cuBLAS plus the separate kernels (few rows, small
layers: `models/decoder.py`); cuBLAS reads big weights closer to the copy bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, norm_w_ptr, residual_ptr, M, N, K, eps,
                 stride_xm, stride_wn, stride_om, stride_rm,
                 NORM: tl.constexpr, GATED: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                 ROWS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, ROWS)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    dtype = w_ptr.dtype.element_ty
    x_rows = x_ptr + m[:, None] * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    sum_sq = tl.zeros([ROWS], tl.float32)
    if USE_DOT:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    else:
        partial = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if GATED:
            gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            xv = (act * up).to(dtype)
        else:
            xv = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            if NORM:
                xf = xv.to(tl.float32)
                sum_sq += tl.sum(xf * xf, 1)
                scale = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                xv = (xf * scale[None, :]).to(dtype)
            else:
                xv = xv.to(dtype)
        if USE_DOT:
            acc = tl.dot(xv, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            partial += xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(partial, 2)
    if NORM:
        acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
    y = acc.to(dtype)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + m[:, None] * stride_rm + n[None, :], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y, mask=out_mask)


_launch_gemv = DirectLaunch(_gemv_kernel)


@dataclass(frozen=True)
class GemvLaunch:
    """How `fused_gemv` splits the work; `gemv_launch` picks the defaults."""

    block_n: int  # weight rows per program
    block_k: int  # columns per loop step
    use_dot: bool  # tl.dot (rows padded to 16) or element-wise products on the CUDA cores
    num_warps: int = 4
    num_stages: int = 3


FMA_MAX_ROWS = 4  # element-wise products keep rows x block_n x block_k floats in registers


def gemv_launch(rows: int) -> GemvLaunch:
    """Default tiles by rows: few rows on the CUDA cores, more rows with `tl.dot` (where
    cuBLAS is mostly faster anyway)."""
    if rows <= 2:
        return GemvLaunch(block_n=4, block_k=512, use_dot=False)
    if rows <= FMA_MAX_ROWS:
        return GemvLaunch(block_n=4, block_k=256, use_dot=False)
    return GemvLaunch(block_n=32, block_k=256, use_dot=True, num_stages=4)


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, gated: bool = False, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, launch: GemvLaunch | None = None
               ) -> torch.Tensor:
    """`x' @ weight.T (+ residual)` for x [M, K] (gated: [M, 2K]) with M <= 16 -> [M, N].

    weight [N, K] (an nn.Linear weight) with a unit last stride; norm_weight [K]: x' =
    rms_norm(x) * norm_weight; gated: x' = silu(x[:, :K]) * x[:, K:]; residual [M, N] is added
    to the product. Never both norm and gated. Outputs are in weight's dtype.
    """
    rows, width = x.shape
    n, k = weight.shape
    assert 0 < rows <= MAX_ROWS, f"fused_gemv takes 1 to {MAX_ROWS} rows, got {rows}"
    assert width == (2 * k if gated else k), \
        f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (gated={gated})"
    assert not (gated and norm_weight is not None), "norm and gated do not combine"
    assert weight.stride(1) == 1, "weight needs a unit last stride"
    launch = launch or gemv_launch(rows)
    assert launch.use_dot or rows <= FMA_MAX_ROWS, \
        f"element-wise products take 1 to {FMA_MAX_ROWS} rows, got {rows}"
    if x.stride(1) != 1:
        x = x.contiguous()
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(1) == 1
    if out is None:
        out = torch.empty((rows, n), dtype=weight.dtype, device=weight.device)
    assert out.shape == (rows, n) and out.stride(1) == 1
    _launch_gemv((cdiv(n, launch.block_n),),
        x, weight, out, weight if norm_weight is None else norm_weight,
        out if residual is None else residual, rows, n, k, eps,
        x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0),
        NORM=norm_weight is not None, GATED=gated, ADD_RESIDUAL=residual is not None,
        ROWS=MAX_ROWS if launch.use_dot else next_power_of_2(rows),
        USE_DOT=launch.use_dot, DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out
