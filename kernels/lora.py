"""The LoRA delta of a batch mixing adapters: grouped shrink (x A^T) and expand (h B^T) GEMMs,
in the manner of Punica's SGMV.

The host sorts the tokens that take an adapter by slot and cuts them into blocks of at most
`BLOCK_T` tokens of one slot (`lora_blocks`); each program multiplies one block by its slot's A
(shrink, into `h`, in sorted order) or B (expand, added into the output rows of its tokens).
Every (token, column) of the output is written by one program, so the adds need no atomics.
Tokens without an adapter are in no block: they cost nothing.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2

BLOCK_T = 16  # tokens per block (tl.dot's least M)


def lora_blocks(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                  np.ndarray]:
    """(order: the tokens with a slot, sorted by slot; per block its slot, first index into
    `order` and token count), all int32 (int64 order)."""
    order = np.nonzero(token_slots >= 0)[0]
    order = order[np.argsort(token_slots[order], kind="stable")]
    slots, starts, counts = [], [], []
    sorted_slots = token_slots[order]
    for slot in np.unique(sorted_slots):
        first, last = np.searchsorted(sorted_slots, [slot, slot + 1])
        for start in range(int(first), int(last), BLOCK_T):
            slots.append(slot)
            starts.append(start)
            counts.append(min(BLOCK_T, int(last) - start))
    as32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    return order.astype(np.int64), as32(slots), as32(starts), as32(counts)


@triton.jit
def _block_tokens(order_ptr, block_slot_ptr, block_start_ptr, block_len_ptr,
                  BLOCK_T: tl.constexpr):
    """This program's block: its slot, its first index into the sorted tokens, which of its
    BLOCK_T lanes hold a token, and those tokens."""
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    start = tl.load(block_start_ptr + block)
    t_mask = tl.arange(0, BLOCK_T) < tl.load(block_len_ptr + block)
    tokens = tl.load(order_ptr + start + tl.arange(0, BLOCK_T), mask=t_mask, other=0)
    return slot, start, t_mask, tokens


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, block_slot_ptr, block_start_ptr,
                   block_len_ptr, K, R, stride_xt, stride_as, stride_ar, stride_ht,
                   DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    slot, start, t_mask, tokens = _block_tokens(order_ptr, block_slot_ptr, block_start_ptr,
                                                block_len_ptr, BLOCK_T)
    t = tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=DOT_PRECISION)
    rows = (start + t).to(tl.int64)
    tl.store(h_ptr + rows[:, None] * stride_ht + r[None, :], acc,
             mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, order_ptr, block_slot_ptr, block_start_ptr,
                   block_len_ptr, N, R, stride_ht, stride_bs, stride_bn, stride_ot,
                   DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    slot, start, t_mask, tokens = _block_tokens(order_ptr, block_slot_ptr, block_start_ptr,
                                                block_len_ptr, BLOCK_T)
    t = tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    h = tl.load(h_ptr + (start + t).to(tl.int64)[:, None] * stride_ht + r[None, :],
                mask=t_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + n[:, None].to(tl.int64) * stride_bn + r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    delta = tl.dot(h, tl.trans(b.to(tl.float32)), input_precision=DOT_PRECISION)
    dst = out_ptr + tokens[:, None] * stride_ot + n[None, :]
    mask = t_mask[:, None] & n_mask[None, :]
    old = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


_launch_shrink = DirectLaunch(_shrink_kernel)
_launch_expand = DirectLaunch(_expand_kernel)


def lora_shrink_expand(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       order: torch.Tensor, block_slot: torch.Tensor, block_start: torch.Tensor,
                       block_len: torch.Tensor, block_n: int = 64) -> None:
    """out[tokens] += (x[tokens] @ a[slot].T) @ b[slot].T per block (`lora_blocks`), in place.
    x [T, K], out [T, N], a [slots, R, K], b [slots, N, R]; unit last strides."""
    num_blocks = block_slot.shape[0]
    if num_blocks == 0:
        return
    k, rank, n = x.shape[1], a.shape[1], b.shape[1]
    assert a.shape[2] == k and b.shape[2] == rank and out.shape[1] == n
    assert x.stride(1) == a.stride(2) == b.stride(2) == out.stride(1) == 1
    block_r = max(16, next_power_of_2(rank))
    # float32 models (the oracle tests) multiply in full precision, not TF32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(order.shape[0], rank, dtype=torch.float32, device=x.device)
    _launch_shrink((num_blocks,), x, a, h, order, block_slot, block_start, block_len, k, rank,
                   x.stride(0), a.stride(0), a.stride(1), h.stride(0), DOT_PRECISION=precision,
                   BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_K=64)
    _launch_expand((num_blocks, cdiv(n, block_n)), h, b, out, order, block_slot, block_start,
                   block_len, n, rank, h.stride(0), b.stride(0), b.stride(1), out.stride(0),
                   DOT_PRECISION=precision, BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_N=block_n)
