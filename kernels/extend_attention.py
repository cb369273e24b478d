"""Paged prefill / extend attention: each request's new tokens attend causally to all its K/V.

A request's new tokens are the last extend_lens[i] of its seq_lens[i] tokens, so the query at
position p (absolute, counting the cached prefix) sees the keys at positions <= p. K/V of the
prefix and of the new tokens are both read from the pool (the new ones are stored before the
call). Grid: (request, query block, query head); each program runs the online-softmax loop
over its request's keys up to the end of its query block. A sliding-window layer (`window` > 0)
lets the query at p see the keys at p - window < position <= p only, and its loop starts at
the block's first visible key (compiled apart: full-attention layers pay nothing).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_store import attention_dtype, from_cache, is_fp8
from kernels.launch import DirectLaunch, cdiv, next_power_of_2

LOG2E = math.log2(math.e)
MIN_DOT = 16  # tl.dot operands need every dimension >= 16


@triton.jit
def _extend_kernel(
    q_ptr, o_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr,
    rows_ptr, seq_lens_ptr, q_starts_ptr, extend_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    window,  # SLIDING: keys within `window` positions of the query, itself included
    k_scale, v_scale,  # FP8_KV: what stored K and V are multiplied by
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_slot, stride_cache_head, stride_pt_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr, FP8_KV: tl.constexpr,
):
    req = tl.program_id(0)
    block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    row = tl.load(rows_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(q_starts_ptr + req).to(tl.int64)
    ext_len = tl.load(extend_lens_ptr + req)
    prefix_len = seq_len - ext_len

    i = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = i < ext_len
    d_mask = d < HEAD_DIM
    q_pos = prefix_len + i
    tok = q_start + i
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if not FP8_KV:  # (an FP8 pool's K/V are dequantized to q's dtype instead)
        q = q.to(k_cache_ptr.dtype.element_ty)
    kv_base = kv_head * stride_cache_head
    page_row = page_table_ptr + row * stride_pt_row
    # Keys up to the block's last query; none for blocks past the request's end (the grid
    # covers the longest request).
    kv_end = tl.minimum(seq_len, prefix_len + (block + 1) * BLOCK_M)
    kv_end = tl.where(block * BLOCK_M < ext_len, kv_end, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    if SLIDING:  # from the block's first visible key, rounded down to a whole block
        lo = tl.maximum(prefix_len + block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    # Full attention: key 0 is visible to every query, so after the first block each running
    # max is finite. With a window a row may see nothing in a block: its max stays -inf, and
    # 0 stands in for it in the exponents (exp2(-inf) = 0, never NaN).
    for n0 in range(lo, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        page = tl.load(page_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        k = tl.load(k_cache_ptr + kv_base + slot[None, :] * stride_cache_slot + d[:, None],
                    mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        k = from_cache(k, k_scale, q.dtype, FP8_KV)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = m_new
        if SLIDING:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_base + slot[:, None] * stride_cache_slot + d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = from_cache(v, v_scale, q.dtype, FP8_KV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


_launch_extend = DirectLaunch(_extend_kernel)


def extend_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) that compile for sm_90 without register spills (the
    gathered K/V tiles carry one 64-bit address per element, so tiles stay modest)."""
    if dtype == torch.float32:  # "ieee" dots run on FMA units and need more registers
        return (32, 16, 4) if head_dim <= 128 else (16, 16, 4)
    if head_dim <= 64:
        return 64, 32, 4
    return (64, 32, 8) if head_dim <= 128 else (32, 16, 8)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    max_extend_len: int,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [tokens, heads, head_dim] (the requests' new tokens, back to back) -> [tokens, heads,
    head_dim] (in q's dtype, or written into `out`). `window` > 0: each query sees its last
    `window` keys only (itself included).

    Request i's queries are q[q_starts[i] : q_starts[i] + extend_lens[i]], at positions
    seq_lens[i] - extend_lens[i] onwards; its K/V (all seq_lens[i] tokens) are in the flat pool
    views k_cache/v_cache [slots, kv_heads, head_dim] at
    page_table[rows[i], p // page_size] * page_size + p % page_size.
    rows, seq_lens, q_starts, extend_lens: [bs] device integer tensors; `max_extend_len` (host)
    sizes the grid. An FP8 pool's K/V are read as stored * k_scale / v_scale, in q's dtype;
    other pools' in their own dtype (q is cast to it), without scales.
    """
    _, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    bs = rows.shape[0]
    assert k_cache.shape[2] == head_dim and v_cache.shape == k_cache.shape, \
        f"cache {tuple(k_cache.shape)} does not hold [slots, kv_heads, {head_dim}]"
    assert num_heads % kv_heads == 0, f"{num_heads} query heads vs {kv_heads} KV heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    assert seq_lens.shape == q_starts.shape == extend_lens.shape == (bs,)
    compute_dtype = attention_dtype(q, k_cache)
    default_m, default_n, num_warps = extend_config(head_dim, compute_dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    for block in (block_m, block_n):
        assert block >= MIN_DOT and block & (block - 1) == 0, f"block {block}: a power of 2 >= 16"
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if bs == 0 or max_extend_len == 0:
        return out
    precision = "ieee" if compute_dtype == torch.float32 else "tf32"  # tf32 only applies to fp32
    grid = (bs, cdiv(max_extend_len, block_m), num_heads)
    _launch_extend(grid,
        q, out, k_cache, v_cache, page_table, rows, seq_lens, q_starts, extend_lens,
        sm_scale * LOG2E, window, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(MIN_DOT, next_power_of_2(head_dim)),
        DOT_PRECISION=precision, SLIDING=window > 0, FP8_KV=is_fp8(k_cache),
        num_warps=num_warps, num_stages=2,
    )
    return out
