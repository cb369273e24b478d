"""Paged decode attention (one query token per request) with GQA, split over the KV length.

Flash-decoding, grid (requests, kv_heads, num_splits): each program takes one contiguous slice
of a request's tokens and attends all query heads of one KV group to it at once (the group is
one `tl.dot` operand, padded to 16 rows). With one split (large batches) the program writes the
output itself; with several it writes a normalized partial output and its log-sum-exp (base 2)
per query head, and a second kernel, grid (requests, kv_heads), merges them in parallel.
The grid depends only on the batch size and `num_splits`, never on the sequence lengths, so a
launch can be captured in a CUDA graph and replayed with new lengths: each request's tokens are
divided among the splits inside the kernel, and splits past its end produce empty partials.
A sliding-window layer (`window` > 0) attends to each request's last `window` tokens: the splits
divide those only (the kernel is compiled apart, so full-attention layers pay nothing).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from kernels.kv_store import attention_dtype, from_cache, is_fp8
from kernels.launch import DirectLaunch, cdiv, next_power_of_2

LOG2E = math.log2(math.e)
MIN_DOT = 16  # tl.dot operands need every dimension >= 16


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, rows_ptr, seq_lens_ptr,
    o_ptr, part_o_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    window,  # SLIDING: keys at positions >= seq_len - window only
    k_scale, v_scale,  # FP8_KV: what stored K and V are multiplied by
    stride_q_tok, stride_q_head,
    stride_cache_slot, stride_cache_head,
    stride_pt_row,
    stride_o_tok, stride_o_head,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)  # int32 or int64 lengths
    first = 0  # the first key attended to
    lo = 0  # where the splits begin: `first` rounded down to a block, so blocks stay aligned
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
        lo = first // BLOCK_N * BLOCK_N
    # Equal slices rounded up to whole blocks, so only the last slice has a ragged end.
    # (Plain integer arithmetic: tl.cdiv is a jit function, costly in the interpreter.)
    per_split = ((seq_len - lo + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N \
        * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
                + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if not FP8_KV:  # (an FP8 pool's K/V are dequantized to q's dtype instead)
        q = q.to(k_cache_ptr.dtype.element_ty)
    kv_base = kv_head * stride_cache_head
    page_row = page_table_ptr + row * stride_pt_row

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every block holds at least one valid key (pos = n0 < end, or the first key), so the
    # running max is finite.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + n
        n_mask = pos < end
        if SLIDING:
            n_mask = n_mask & (pos >= first)
        if PAGE_SIZE % BLOCK_N == 0:
            # Blocks start at multiples of BLOCK_N, so a block lies inside one page.
            page = tl.load(page_row + n0 // PAGE_SIZE).to(tl.int64)
            slot = page * PAGE_SIZE + n0 % PAGE_SIZE + n
        else:
            page = tl.load(page_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
        # K is loaded transposed, [BLOCK_D, BLOCK_N], to be the right operand of q @ k.
        k = tl.load(k_cache_ptr + kv_base + slot[None, :] * stride_cache_slot + d[:, None],
                    mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        k = from_cache(k, k_scale, q.dtype, FP8_KV)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_base + slot[:, None] * stride_cache_slot + d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = from_cache(v, v_scale, q.dtype, FP8_KV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    nonempty = denom > 0
    out = acc / tl.where(nonempty, denom, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + req.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head
                 + d[None, :], out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, denom, 1.0)), float("-inf"))
        po = part_o_ptr + req * stride_po_req + heads[:, None] * stride_po_head \
            + split * stride_po_split + d[None, :]
        tl.store(po, out, mask=out_mask)
        tl.store(part_lse_ptr + req * stride_pl_req + heads * stride_pl_head + split, lse,
                 mask=g_mask)


_launch_decode_split = DirectLaunch(_decode_split_kernel)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the NUM_SPLITS partials of each query head of KV group program_id(1) of request
    program_id(0). One [splits, head_dim] load per head, unrolled over the group so that every
    load is in flight at once."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        lse = tl.load(part_lse_ptr + req * stride_pl_req + head * stride_pl_head + s,
                      mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # a request of length 0 (padding) gets zeros
        weight = tl.exp2(lse - m)
        part = tl.load(part_o_ptr + req * stride_po_req + head * stride_po_head
                       + s[:, None] * stride_po_split + d[None, :],
                       mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        total = tl.sum(weight, 0)
        out = tl.sum(weight[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + d,
                 out.to(o_ptr.dtype.element_ty), mask=d_mask)


_launch_decode_merge = DirectLaunch(_decode_merge_kernel)


@dataclass(frozen=True)
class DecodeLaunch:
    """Tile and schedule of the decode kernel; `decode_launch` picks the defaults."""

    block_n: int  # tokens per loop step
    num_warps: int = 4
    num_stages: int = 2


LAUNCH_ENV = "MINISGL_DECODE_LAUNCH"  # e.g. "block_n=64,num_warps=4,num_stages=3" (tuning)


def decode_launch(head_dim: int, dtype: torch.dtype, num_splits: int = 1) -> DecodeLaunch:
    """Default tiles: with one split (large batches, bandwidth-bound) 64-token steps and 3
    stages; with splits (small batches: short, latency-bound slices) 32-token steps and 2
    stages; 4 warps. fp32 or
    heads wider than 128 take 16-token steps (more would spill registers on sm_90: the
    gathered K/V tiles carry one 64-bit address per element). `MINISGL_DECODE_LAUNCH`
    overrides fields for 16-bit heads (tuning runs)."""
    if dtype == torch.float32 or head_dim > 128:
        return DecodeLaunch(block_n=16)
    tiles = {"block_n": 32, "num_stages": 2} if num_splits > 1 else \
        {"block_n": 64, "num_stages": 3}
    return DecodeLaunch(**{**tiles, **_launch_override(os.environ.get(LAUNCH_ENV, ""))})


@cache
def _launch_override(text: str) -> dict[str, int]:
    fields = {"block_n", "num_warps", "num_stages"}
    override: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in fields or not value.isdigit():
            raise ValueError(f"{LAUNCH_ENV}: {item!r} is not one of {sorted(fields)}=<integer>")
        override[name] = int(value)
    return override


def decode_num_splits(batch_size: int, num_kv_heads: int, max_splits: int,
                      target_programs: int = 256) -> int:
    """KV splits per request: enough (batch, kv head, split) programs to fill the GPU's SMs.

    Depends only on the batch size and static settings, so a CUDA graph captured for a batch
    size keeps a valid split count whatever the lengths are at replay."""
    programs = max(1, batch_size * num_kv_heads)
    return max(1, min(max_splits, next_power_of_2(cdiv(target_programs, programs))))


@dataclass(frozen=True)
class DecodeWorkspace:
    """Scratch of `decode_attention` with several splits: flat fp32 partial outputs and
    log-sum-exps."""

    partial_o: torch.Tensor
    partial_lse: torch.Tensor


def decode_workspace(max_batch_size: int, num_heads: int, head_dim: int, max_splits: int,
                     device: torch.device | str) -> DecodeWorkspace:
    """Big enough for any batch up to `max_batch_size` with up to `max_splits` splits."""
    slots = max_batch_size * num_heads * max_splits
    return DecodeWorkspace(
        partial_o=torch.empty(slots * head_dim, dtype=torch.float32, device=device),
        partial_lse=torch.empty(slots, dtype=torch.float32, device=device),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    sm_scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    launch: DecodeLaunch | None = None,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [bs, heads, head_dim] attends to its request's first seq_lens[i] tokens -> [bs, heads,
    head_dim] (in q's dtype, or written into `out`); with `window` > 0 to the last `window` of
    them only.

    k_cache/v_cache: flat pool views [slots, kv_heads, head_dim]; a request's token at position
    p lives in slot page_table[rows[i], p // page_size] * page_size + p % page_size.
    rows [bs] and seq_lens [bs] are device integer tensors (a length of 0 gives zeros).
    `workspace` (from `decode_workspace`) avoids allocating the scratch on every call; it must
    hold bs * heads * num_splits partials. `launch`: tiles and schedule (`decode_launch`).
    An FP8 pool's K/V are read as stored * k_scale / v_scale, in q's dtype; other pools' in
    their own dtype (q is cast to it), without scales.
    """
    bs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert k_cache.shape[2] == head_dim and v_cache.shape == k_cache.shape, \
        f"cache {tuple(k_cache.shape)} does not hold [slots, kv_heads, {head_dim}]"
    assert num_heads % kv_heads == 0, f"{num_heads} query heads vs {kv_heads} KV heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    assert rows.shape == (bs,) and seq_lens.shape == (bs,)
    compute_dtype = attention_dtype(q, k_cache)
    launch = launch or decode_launch(head_dim, compute_dtype, num_splits)
    block_n = launch.block_n
    assert num_splits >= 1 and block_n >= MIN_DOT and block_n & (block_n - 1) == 0
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if bs == 0:
        return out
    if workspace is None:
        workspace = decode_workspace(bs, num_heads, head_dim, num_splits, q.device)
    partials = bs * num_heads * num_splits
    assert workspace.partial_o.numel() >= partials * head_dim \
        and workspace.partial_lse.numel() >= partials, "decode workspace too small"
    partial_o = workspace.partial_o[: partials * head_dim].view(bs, num_heads, num_splits,
                                                                head_dim)
    partial_lse = workspace.partial_lse[:partials].view(bs, num_heads, num_splits)
    group = num_heads // kv_heads
    block_g = max(MIN_DOT, next_power_of_2(group))
    block_d = max(MIN_DOT, next_power_of_2(head_dim))
    block_s = max(2, next_power_of_2(num_splits))
    precision = "ieee" if compute_dtype == torch.float32 else "tf32"  # tf32 only applies to fp32
    _launch_decode_split((bs, kv_heads, num_splits),
        q, k_cache, v_cache, page_table, rows, seq_lens, out, partial_o, partial_lse,
        sm_scale * LOG2E, window, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        partial_o.stride(0), partial_o.stride(1), partial_o.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=precision,
        SLIDING=window > 0, FP8_KV=is_fp8(k_cache), num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if num_splits > 1:
        _launch_decode_merge((bs, kv_heads),
            partial_o, partial_lse, out,
            partial_o.stride(0), partial_o.stride(1), partial_o.stride(2),
            partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=block_s,
            BLOCK_D=block_d, num_warps=4,
        )
    return out
