"""Scatter this step's K and V into the paged pool, one program per token.

An FP8 pool stores `saturate(value, scale)` with its layer's scale and attention reads back
`stored * scale`: `to_cache` and `from_cache` are those two conversions, shared by every kernel
that writes or reads the pool (the prologue, decode and extend attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import saturate_e4m3
from kernels.launch import DirectLaunch, next_power_of_2
from minisgl_backend.quantization.fp8 import FP8


@triton.jit
def to_cache(x, scale, cache_ptr, FP8_KV: tl.constexpr):
    """`x` as the pool at `cache_ptr` stores it: x / scale saturated to e4m3 (bit for bit
    `fp8.saturate`) in an FP8 pool, else cast to the pool's dtype."""
    if FP8_KV:
        x = saturate_e4m3(x, scale)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def from_cache(x, scale, dtype: tl.constexpr, FP8_KV: tl.constexpr):
    """Values loaded from the pool as attention reads them: stored * scale in float32, then
    `dtype`, from an FP8 pool; as loaded from any other."""
    if FP8_KV:
        x = (x.to(tl.float32) * scale).to(dtype)
    return x


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def attention_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """The dtype attention kernels multiply in: q's over an FP8 pool (its K/V are dequantized
    to it), the pool's over any other (q is cast to it)."""
    return q.dtype if is_fp8(cache) else cache.dtype


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale, v_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_KV: tl.constexpr,
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
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, k_cache_ptr, FP8_KV), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr, FP8_KV), mask=mask)


_launch_kv_store = DirectLaunch(_kv_store_kernel)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k/v [tokens, kv_heads, head_dim] -> k_cache/v_cache [pool slots, kv_heads, head_dim].

    `slots` [tokens] (any integer dtype) is each token's flat pool slot. An FP8 cache gets
    `saturate(k, k_scale)` and `saturate(v, v_scale)`; others ignore the scales. The launch
    shape depends only on the number of tokens, so it can be captured in a CUDA graph."""
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
        k, v, k_cache, v_cache, slots, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(kv_heads), BLOCK_D=next_power_of_2(head_dim),
        FP8_KV=is_fp8(k_cache),
    )
