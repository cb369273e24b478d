"""The attention prologue in one kernel: q/k RMSNorm (optional), RoPE, and the KV-pool store.

Replaces, per layer, the `.contiguous()` copies, the two head norms, the rotary kernel and the
two scatters that sit between the QKV GEMM and attention. Each program takes one token and a
group of `heads_per_program` heads of one kind: query groups write their heads rotated to
`out`; KV groups rotate their K heads into the token's pool slot and copy the matching V heads
there unchanged. One head per program spreads a token over the most SMs (decode at small
batch); several heads per program load the token's position and cos/sin once and give each
program more work (many tokens). The grid depends only on the token and head counts, so a
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_store import is_fp8, to_cache
from kernels.launch import DirectLaunch, cdiv


@triton.jit
def _norm_rope_heads(src, dst, mask, norm_w_ptr, cos, sin, eps, kv_scale,
                     HALF: tl.constexpr, HAS_NORM: tl.constexpr, FP8_KV: tl.constexpr):
    """Heads of HEAD_DIM = 2 * HALF values, one per row of the [heads, 1] pointer blocks `src`
    and `dst` (rows outside `mask` are skipped): optional RMSNorm, then NeoX ("rotate half")
    RoPE, all in fp32. `dst` may be `src`: every element is read by the thread that writes it,
    before it writes. FP8_KV: `dst` is an FP8 pool, which gets the result rounded to src's
    dtype (the K the unfused path stores) quantized with `kv_scale`."""
    i = tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1))[:, None] / (2 * HALF)
        scale = tl.rsqrt(mean_sq + eps)
        x1 = x1 * scale * tl.load(norm_w_ptr + i).to(tl.float32)
        x2 = x2 * scale * tl.load(norm_w_ptr + HALF + i).to(tl.float32)
    lo = x1 * cos - x2 * sin
    hi = x2 * cos + x1 * sin
    if FP8_KV:
        lo = lo.to(src.dtype.element_ty)
        hi = hi.to(src.dtype.element_ty)
    tl.store(dst + i, to_cache(lo, kv_scale, dst, FP8_KV), mask=mask)
    tl.store(dst + HALF + i, to_cache(hi, kv_scale, dst, FP8_KV), mask=mask)


@triton.jit
def _qkv_prologue_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, slots_ptr,
    out_ptr, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, eps, k_scale, v_scale,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head, stride_cs_pos, stride_cache_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr, HAS_NORM: tl.constexpr, FP8_KV: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_GROUPS: tl.constexpr = (NUM_HEADS + HEADS - 1) // HEADS
    i = tl.arange(0, HALF)[None, :]
    # The table row holds cos of every frequency, then sin.
    cs_row = cos_sin_ptr + tl.load(positions_ptr + tok).to(tl.int64) * stride_cs_pos
    cos = tl.load(cs_row + i)
    sin = tl.load(cs_row + HALF + i)
    if group < Q_GROUPS:
        head = (group * HEADS + tl.arange(0, HEADS))[:, None]
        _norm_rope_heads(q_ptr + tok * stride_q_tok + head * stride_q_head,
                         out_ptr + tok * stride_o_tok + head * stride_o_head,
                         head < NUM_HEADS, q_norm_ptr, cos, sin, eps, 1.0, HALF, HAS_NORM,
                         False)
    else:
        kv_head = ((group - Q_GROUPS) * HEADS + tl.arange(0, HEADS))[:, None]
        mask = kv_head < NUM_KV_HEADS
        dst = tl.load(slots_ptr + tok).to(tl.int64) * stride_cache_slot \
            + kv_head * stride_cache_head
        _norm_rope_heads(k_ptr + tok * stride_k_tok + kv_head * stride_k_head,
                         k_cache_ptr + dst, mask, k_norm_ptr, cos, sin, eps, k_scale, HALF,
                         HAS_NORM, FP8_KV)
        d = tl.arange(0, HEAD_DIM)[None, :]
        v = tl.load(v_ptr + tok * stride_v_tok + kv_head * stride_v_head + d, mask=mask)
        tl.store(v_cache_ptr + dst + d, to_cache(v, v_scale, v_cache_ptr, FP8_KV), mask=mask)


# Below ~32 tokens a head per program keeps more SMs busy; from there on, groups of 8 heads give
# each program enough work (and the prologue's time grows far more slowly with the tokens).
MANY_TOKENS = 32
HEADS_PER_PROGRAM_MANY_TOKENS = 8


_launch_qkv_prologue = DirectLaunch(_qkv_prologue_kernel)


def heads_per_program_for(tokens: int) -> int:
    return 1 if tokens < MANY_TOKENS else HEADS_PER_PROGRAM_MANY_TOKENS


def fused_qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    heads_per_program: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Norm + RoPE q and k, store k and v in the pool; return the rotated q [tokens, heads, dim].

    q [tokens, heads, dim], k and v [tokens, kv_heads, dim]: any token and head strides with a
    unit last stride, e.g. the views of one QKV GEMM output that `QKVParallelLinear` returns
    (after `.view(tokens, -1, dim)`). They are only read: k and v keep their raw values.
    positions, out_slots [tokens]: integer device tensors (positions must lie inside the table:
    nothing is checked on the device). cos_sin_cache [max_positions, dim] float32: cos of every
    frequency then sin (`RotaryEmbedding`'s table). k_cache/v_cache: flat pool views
    [slots, kv_heads, dim]; row out_slots[t] gets token t's rotated K and raw V. Slots not
    named in out_slots are untouched; out_slots should not repeat (repeats race).
    q_norm_weight/k_norm_weight [dim], both or neither: RMSNorm of each head with `eps` first.
    out: where q goes, [tokens, heads, dim] with a unit last stride (`out=q` rotates in place,
    into the GEMM output); by default a new contiguous tensor of q's dtype. Math is fp32; every
    output is rounded once to its tensor's dtype. heads_per_program: a power of two (see the
    module's docstring; by default `heads_per_program_for(tokens)`); the result does not
    depend on it. An FP8 pool gets K and V as the unfused path stores them (`store_kv`): the
    rotated K rounded to k's dtype, then quantized with `k_scale`; V with `v_scale`.
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, \
        f"head_dim must be a power of two (got {head_dim})"
    if heads_per_program is None:
        heads_per_program = heads_per_program_for(tokens)
    assert heads_per_program >= 1 and heads_per_program & (heads_per_program - 1) == 0, \
        f"heads_per_program must be a power of two (got {heads_per_program})"
    assert k.shape == (tokens, num_kv_heads, head_dim) and v.shape == k.shape, \
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, \
        "q, k and v need a unit stride along head_dim"
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape, \
        f"cache {tuple(k_cache.shape)} does not hold [slots, {num_kv_heads}, {head_dim}]"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim \
        and cos_sin_cache.stride(1) == 1 and cos_sin_cache.dtype == torch.float32, \
        f"cos/sin table {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype} is not " \
        f"[positions, {head_dim}] float32"
    assert positions.shape == (tokens,) and out_slots.shape == (tokens,), \
        f"positions {tuple(positions.shape)} / out_slots {tuple(out_slots.shape)} vs {tokens}"
    has_norm = q_norm_weight is not None
    assert (k_norm_weight is not None) == has_norm, "give both q and k norm weights, or neither"
    if has_norm:
        assert q_norm_weight.shape == (head_dim,) and k_norm_weight.shape == (head_dim,)
        assert q_norm_weight.stride(0) == 1 and k_norm_weight.stride(0) == 1
    if out is None:
        out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if tokens == 0:
        return out
    # Unused pointers when there is no norm: any tensor will do.
    q_w = q_norm_weight if has_norm else cos_sin_cache
    k_w = k_norm_weight if has_norm else cos_sin_cache
    groups = cdiv(num_heads, heads_per_program) \
        + cdiv(num_kv_heads, heads_per_program)
    _launch_qkv_prologue((tokens, groups),
        q, k, v, positions, cos_sin_cache, out_slots, out, k_cache, v_cache, q_w, k_w, eps,
        float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS=heads_per_program, HAS_NORM=has_norm, FP8_KV=is_fp8(k_cache),
        num_warps=max(1, min(4, heads_per_program * head_dim // 128)),
    )
    return out
