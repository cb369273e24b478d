"""Matrix-vector products for a few rows (batch-1 to batch-16 decode), with the layer's small
neighbours folded in.

At batch 1 a decoder layer reads its weights once per token, and the kernels between its
GEMVs (add + RMSNorm, SiLU-and-mul) are tiny but each costs a launch and a gap in the CUDA
graph: for Llama-3.1-8B they take about a sixth of the step (benchmark/RESULTS.md). Here one
kernel computes `out = x' @ weight.T` for x [M <= 16, K], where x' is, optionally,

- `rms_norm(x) * norm_weight` (the layer's input / post-attention norm; each program computes
  the rows' RMS itself in a first pass over x, which is small and sits in L2), or
- `silu(gate) * up` for x = [gate | up] [M, 2K] (the MLP's activation),

and adds, optionally, `residual` to the result (the residual connection after o_proj and
down_proj). Rounding follows HF transformers' torch ops: the normalized row is rounded to the
dtype before the weight multiply, SiLU's result before the product with `up`, the product
before the GEMV, the GEMV's result before the residual add. Programs split N into blocks of
`block_n` rows of the weight and loop over K. Two ways to multiply: `tl.dot` with the few rows
of x padded to 16 (the GEMV is bound by weight reads, so unused MMA lanes cost nothing), or
(`use_dot=False`, for one or two rows) a broadcast multiply and row sum on the CUDA cores, with
the rows padded only to a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    if NORM:
        sum_sq = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :],
                         other=0.0).to(tl.float32)
            sum_sq += tl.sum(xv * xv, 1)
        inv_rms = tl.rsqrt(sum_sq / K + eps)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        if GATED:
            gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            xv = (act * up).to(dtype)
        else:
            xv = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            if NORM:
                normed = (xv.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
                scale = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                xv = (normed * scale[None, :]).to(dtype)
            else:
                xv = xv.to(dtype)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(xv, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    y = acc.to(dtype)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + m[:, None] * stride_rm + n[None, :], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y, mask=out_mask)


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, gated: bool = False, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
               num_warps: int = 4, num_stages: int = 3, use_dot: bool = True) -> torch.Tensor:
    """`x' @ weight.T (+ residual)` for x [M, K] (gated: [M, 2K]) with M <= 16 -> [M, N].

    weight [N, K] (an nn.Linear weight) with a unit last stride; norm_weight [K]: x' =
    rms_norm(x) * norm_weight; gated: x' = silu(x[:, :K]) * x[:, K:]; residual [M, N] is added
    to the product. Never both norm and gated. Outputs are in weight's dtype. `use_dot=False`
    multiplies on the CUDA cores (meant for one or two rows: its registers grow with the rows).
    """
    rows, width = x.shape
    n, k = weight.shape
    assert 0 < rows <= MAX_ROWS, f"fused_gemv takes 1 to {MAX_ROWS} rows, got {rows}"
    assert width == (2 * k if gated else k), \
        f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (gated={gated})"
    assert not (gated and norm_weight is not None), "norm and gated do not combine"
    assert weight.stride(1) == 1, "weight needs a unit last stride"
    if x.stride(1) != 1:
        x = x.contiguous()
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(1) == 1
    if out is None:
        out = torch.empty((rows, n), dtype=weight.dtype, device=weight.device)
    assert out.shape == (rows, n) and out.stride(1) == 1
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, weight if norm_weight is None else norm_weight,
        out if residual is None else residual, rows, n, k, eps,
        x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0),
        NORM=norm_weight is not None, GATED=gated, ADD_RESIDUAL=residual is not None,
        ROWS=MAX_ROWS if use_dot else triton.next_power_of_2(rows), USE_DOT=use_dot,
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
