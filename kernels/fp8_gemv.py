"""FP8 (e4m3) weights times a few rows of activations (batch-1 to batch-16 decode).

At batch 1 a linear layer is bound by its weight reads; e4m3 weights are half the bytes of
bf16 ones, which is where FP8 decode gets its speed. One kernel computes
`reference_linear(x, weight, weight_scale, ...)` for x [M <= 16, K]: programs split N into
blocks of `block_n` weight rows (hundreds of programs stream the weight) and loop over K,
quantizing the x slice they read exactly as `fp8.quantize_input` does:

- per token: the row's amax is needed before the first value is rounded, so each program
  first reads its rows of x whole (x is tiny next to the weight slice it streams);
- per token and column group (block-scaled weights): the group is the K step, its amax local;
- static: one given scale.

The products accumulate in float32: e4m3 x e4m3 products on the CUDA cores or through
`tl.dot` (rows padded to 16, as in `kernels/gemv.py`, whose launch settings this shares);
scales that change along K (column groups, weight blocks) are applied per K step, the others
once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import dynamic_scale, saturate_e4m3
from kernels.gemv import FMA_MAX_ROWS, MAX_ROWS, GemvLaunch
from kernels.launch import DirectLaunch, cdiv, next_power_of_2
from minisgl_backend.quantization.fp8 import FP8


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, input_scale_ptr, bias_ptr, out_ptr, M, N, K,
                     stride_xm, stride_wn, stride_wsn, stride_wsk, stride_om,
                     GROUPED_INPUT: tl.constexpr, STATIC_INPUT: tl.constexpr,
                     BLOCK_WEIGHT: tl.constexpr, GROUP_N: tl.constexpr,
                     GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                     USE_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, ROWS)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    x_rows = x_ptr + m[:, None] * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    if STATIC_INPUT:
        x_scale = tl.load(input_scale_ptr).to(tl.float32)
    elif not GROUPED_INPUT:  # per token
        amax = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        x_scale = dynamic_scale(tl.max(amax, 1))[:, None]
    if BLOCK_WEIGHT:
        w_scale_rows = w_scale_ptr + (n // GROUP_N) * stride_wsn
    if USE_DOT:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    else:
        partial = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if GROUPED_INPUT:  # the K step is the column group
            step_x_scale = dynamic_scale(tl.max(tl.abs(x.to(tl.float32)), 1))[:, None]
            x_q = saturate_e4m3(x, step_x_scale)
        else:
            x_q = saturate_e4m3(x, x_scale)
        if BLOCK_WEIGHT:
            step_w_scale = tl.load(w_scale_rows + (k0 // GROUP_K) * stride_wsk, mask=n_mask,
                                   other=0.0)
        if USE_DOT:
            product = tl.dot(x_q, tl.trans(w))
            if GROUPED_INPUT:
                product = product * step_x_scale
            if BLOCK_WEIGHT:
                product = product * step_w_scale[None, :]
            acc += product
        else:
            xv = x_q.to(tl.float32)
            wv = w.to(tl.float32)
            if GROUPED_INPUT:
                xv = xv * step_x_scale
            if BLOCK_WEIGHT:
                wv = wv * step_w_scale[:, None]
            partial += xv[:, None, :] * wv[None, :, :]
    if not USE_DOT:
        acc = tl.sum(partial, 2)
    if not GROUPED_INPUT:
        acc = acc * x_scale
    if not BLOCK_WEIGHT:
        acc = acc * tl.load(w_scale_ptr + n * stride_wsn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


_launch_fp8_gemv = DirectLaunch(_fp8_gemv_kernel)


def fp8_gemv_launch(rows: int, group_k: int | None = None) -> GemvLaunch:
    """Default tiles by rows; `group_k`: the K step a column group or weight block fixes.
    e4m3 weights are half bf16's bytes: twice the K step of the bf16 GEMV for the same load."""
    if rows <= 2:
        launch = GemvLaunch(block_n=8 if rows == 1 else 4, block_k=512, use_dot=False)
    elif rows <= FMA_MAX_ROWS:
        launch = GemvLaunch(block_n=4, block_k=256, use_dot=False)
    else:
        launch = GemvLaunch(block_n=32, block_k=256, use_dot=True, num_stages=4)
    if group_k is None:
        return launch
    return GemvLaunch(block_n=launch.block_n, block_k=group_k, use_dot=launch.use_dot,
                      num_warps=launch.num_warps, num_stages=launch.num_stages)


def fp8_gemv(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *,
             block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, launch: GemvLaunch | None = None
             ) -> torch.Tensor:
    """`fp8.reference_linear(x, w_q, w_scale, block=..., input_scale=..., bias=...)` for
    x [M <= 16, K] (bf16, fp16 or float32) -> [M, N] in x's dtype.

    w_q [N, K] e4m3 with a unit last stride; w_scale float32 per output channel ([N, 1], or
    one element) or, with `block` = (bn, bk), per block [ceil(N / bn), ceil(K / bk)]; bk is
    then the K step (a power of two >= 32 where `tl.dot` multiplies). input_scale: the static
    scale (one element), else x is quantized per token (per token and bk columns with blocks).
    """
    rows, k = x.shape
    n = w_q.shape[0]
    assert 0 < rows <= MAX_ROWS, f"fp8_gemv takes 1 to {MAX_ROWS} rows, got {rows}"
    assert w_q.shape[1] == k, f"x {tuple(x.shape)} does not fit weight {tuple(w_q.shape)}"
    assert w_q.dtype == FP8 and w_q.stride(1) == 1, "w_q is float8_e4m3fn with a unit last stride"
    assert w_scale.dtype == torch.float32, "w_scale is float32"
    if x.stride(1) != 1:
        x = x.contiguous()
    if block is None:
        w_scale = w_scale.reshape(1, 1) if w_scale.numel() == 1 else w_scale.reshape(n, 1)
        w_scale = w_scale.expand(n, 1)
        group_k = None
    else:
        assert w_scale.shape == (cdiv(n, block[0]), cdiv(k, block[1])), \
            f"block scale {tuple(w_scale.shape)} does not fit {tuple(w_q.shape)} / {block}"
        group_k = block[1]
    assert input_scale is None or input_scale.numel() == 1, "input_scale is one float"
    # Column groups as wide as the row are per token.
    grouped = input_scale is None and group_k is not None and group_k < k
    launch = launch or fp8_gemv_launch(rows, group_k)
    assert group_k is None or launch.block_k == group_k, "the K step is the block's width"
    assert launch.use_dot or rows <= FMA_MAX_ROWS, \
        f"element-wise products take 1 to {FMA_MAX_ROWS} rows, got {rows}"
    assert launch.block_k & (launch.block_k - 1) == 0, "block_k is a power of two"
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _launch_fp8_gemv(
        (cdiv(n, launch.block_n),), x, w_q, w_scale,
        w_scale if input_scale is None else input_scale, out if bias is None else bias, out,
        rows, n, k, x.stride(0), w_q.stride(0), w_scale.stride(0),
        w_scale.stride(1) if block is not None else 0, out.stride(0),
        GROUPED_INPUT=grouped, STATIC_INPUT=input_scale is not None,
        BLOCK_WEIGHT=block is not None, GROUP_N=block[0] if block else 1,
        GROUP_K=group_k or launch.block_k, HAS_BIAS=bias is not None,
        ROWS=MAX_ROWS if launch.use_dot else next_power_of_2(rows), USE_DOT=launch.use_dot,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out
