"""Fused MoE experts (Qwen3-MoE): grouped GEMMs over the pairs sorted by expert.

`fused_experts` computes what `experts_forward_torch` does, with a fixed number of launches:
  align (`moe_align`): pairs (token, slot) sorted by expert in blocks of BLOCK_M rows;
  GEMM 1, grid (blocks, 2I tiles): x rows gathered by token, times w13[e].T -> [pairs, 2I];
  silu(gate) * up -> [pairs, I];
  GEMM 2, grid (blocks, H tiles): times w2[e].T, scaled by the routing weight -> [pairs, H];
  sum over each token's top_k slots -> [tokens, H].
Every buffer's size and every grid depend only on (tokens, top_k, experts) and the weight
shapes, never on the routing, and nothing is read back to the host, so a whole call can be
captured in a CUDA graph; blocks past the routing's padded length exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe_align import BlockAlignment, align_block_size
from minisgl_backend.layers.fast_ops import silu_and_mul

MIN_DOT = 16  # tl.dot operands need every dimension >= 16


@dataclass(frozen=True)
class MoETileConfig:
    block_m: int  # rows (pairs) per block: also the alignment's padding unit
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_tile_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoETileConfig:
    """Small blocks while experts get few rows each (decode: less padding, more programs to
    stream the weights), big ones for prefill. fp32 halves the K tile (shared memory)."""
    block_k = 32 if dtype == torch.float32 else 64
    if num_pairs <= 16 * num_experts:
        return MoETileConfig(16, 64, block_k, num_warps=4, num_stages=4)
    return MoETileConfig(64, 128, block_k, num_warps=8, num_stages=3)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, scale_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs,
    stride_am, stride_we, stride_wn, stride_cm,
    A_ROW_DIV: tl.constexpr,  # pair -> row of a: top_k for x, 1 for the per-pair activations
    HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[pair, n-tile] = a[pair // A_ROW_DIV] @ w[expert].T (* scale[pair]) for one block."""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    pairs = tl.where(valid, pairs, 0).to(tl.int64)
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_am + k[None, :]
    # W[e] is [N, K] row-major: load it transposed, [BLOCK_K, BLOCK_N], as the right operand.
    w_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None]

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = k0 + k < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, align: BlockAlignment, num_pairs: int,
                 a_row_div: int, config: MoETileConfig,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """[num_pairs, N] in a's dtype: row p = a[p // a_row_div] @ w[expert of p].T, times
    scale.flatten()[p] if given. a [rows, K], w [experts, N, K], both with a unit last stride."""
    num_experts, n, k = w.shape
    assert a.shape[1] == k and a.stride(1) == 1 and w.stride(2) == 1, \
        f"a {tuple(a.shape)} / w {tuple(w.shape)}: K differs or is not contiguous"
    assert align.block_m == config.block_m, f"aligned for {align.block_m}-row blocks, not {config}"
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    num_blocks = align.expert_ids.numel()
    if num_blocks == 0:
        return out
    grid = (num_blocks, triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, scale if scale is not None else a, align.sorted_pair_ids, align.expert_ids,
        align.num_padded, n, k, num_pairs,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, HAS_SCALE=scale is not None, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  config: MoETileConfig | None = None) -> torch.Tensor:
    """out[t] = sum over slots s of topk_weights[t, s] * w2[e] @ (silu(g) * u), where
    [g; u] = w13[e] @ x[t] and e = topk_ids[t, s]: `experts_forward_torch`'s result.

    x [tokens, H] (bf16, fp16 or fp32, unit last stride); w13 [E, 2I, H] (gate rows, then up
    rows) and w2 [E, H, I] in x's dtype, unit last stride; topk_weights [tokens, top_k] (any
    float dtype) and topk_ids [tokens, top_k] (any integer dtype, ids in [0, E): not checked
    on the device). Returns a new [tokens, H] tensor in x's dtype. GEMMs accumulate in fp32;
    the [pairs, 2I], [pairs, I] and [pairs, H] intermediates are rounded to x's dtype.
    `config` overrides the tiles chosen by `default_tile_config`."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, two_inter, hidden) and two_inter % 2 == 0, \
        f"w13 {tuple(w13.shape)} is not [experts, 2 * intermediate, {hidden}]"
    assert w2.shape == (num_experts, hidden, two_inter // 2), \
        f"w2 {tuple(w2.shape)} is not [{num_experts}, {hidden}, {two_inter // 2}]"
    assert x.dtype == w13.dtype == w2.dtype, f"dtypes {x.dtype}, {w13.dtype}, {w2.dtype} differ"
    assert topk_ids.shape == (tokens, top_k) and topk_weights.shape == (tokens, top_k), \
        f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} vs {tokens}"
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    config = config or default_tile_config(num_pairs, num_experts, x.dtype)
    assert min(config.block_m, config.block_n, config.block_k) >= MIN_DOT and all(
        b & (b - 1) == 0 for b in (config.block_m, config.block_n, config.block_k)), \
        f"{config}: tiles must be powers of two >= {MIN_DOT}"
    if x.stride(1) != 1:
        x = x.contiguous()
    align = align_block_size(topk_ids, num_experts, config.block_m)
    gate_up = grouped_gemm(x, w13, align, num_pairs, top_k, config)
    act = silu_and_mul(gate_up)
    down = grouped_gemm(act, w2, align, num_pairs, 1, config,
                        scale=topk_weights.contiguous())
    return down.view(tokens, top_k, hidden).sum(dim=1)
