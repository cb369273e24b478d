"""Scatter this step's K and V into the paged pool, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, next_power_of_2


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_launch_kv_store = DirectLaunch(_kv_store_kernel)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v [tokens, kv_heads, head_dim] -> k_cache/v_cache [pool slots, kv_heads, head_dim].

    `slots` [tokens] (any integer dtype) is each token's flat pool slot. The launch shape
    depends only on the number of tokens, so it can be captured in a CUDA graph."""
    tokens, kv_heads, head_dim = k.shape
    assert v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert k_cache.shape[1:] == (kv_heads, head_dim) and v_cache.shape == k_cache.shape, \
        f"cache {tuple(k_cache.shape)} does not hold [slots, {kv_heads}, {head_dim}]"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    assert slots.shape == (tokens,), f"slots {tuple(slots.shape)} vs {tokens} tokens"
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if tokens == 0:
        return
    _launch_kv_store((tokens,),
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )
