"""The LoRA delta of a batch mixing adapters: grouped shrink (x A^T) and expand (h B^T) GEMMs,
in the manner of Punica's SGMV.

The host sorts the tokens that take an adapter by slot and cuts them into blocks of at most
`BLOCK_T` tokens of one slot (`pack_blocks`); each program multiplies one block by its slot's A
(shrink, into `h`, in sorted order) or B (expand, added into the output rows of its tokens), so
each adapter present is read once per block whatever the number of adapters, and tokens without
one cost nothing. Every (token, column) of the output is written by one program: no atomics.

The block table may be padded with empty blocks (count 0, whose programs return at once): a
CUDA graph launches a fixed grid, sized by `max_blocks` for its batch size, and a step fills
the table's first entries.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2

BLOCK_T = 16  # tokens per block (tl.dot's least M)
SHRINK_BLOCK_K = 64
SHRINK_K_PER_SPLIT = 256  # the least K a shrink program takes, up to SHRINK_MAX_SPLITS programs
SHRINK_MAX_SPLITS = 16
# The block table: tokens sorted by slot, then per block its slot, first index, token count.
BlockTable = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def max_blocks(tokens: int, slots: int) -> int:
    """The most blocks `tokens` tokens over `slots` adapter slots can need: every slot's
    tokens fill whole blocks except its last."""
    return cdiv(tokens, BLOCK_T) + min(slots, tokens)


def pack_blocks(token_slots: np.ndarray, token_capacity: int | None = None,
                block_capacity: int | None = None) -> tuple[np.ndarray, int]:
    """The block table of a step whose tokens take slots `token_slots` (-1: none), packed in
    one int64 array [order (token_capacity), slot, start, count (block_capacity each)] for one
    copy, and the number of blocks it holds. Capacities default to exactly what is needed;
    padding is token 0 and empty blocks."""
    order = np.nonzero(token_slots >= 0)[0]
    order = order[np.argsort(token_slots[order], kind="stable")]
    sorted_slots = token_slots[order]
    present, firsts, sizes = np.unique(sorted_slots, return_index=True, return_counts=True)
    per_slot = -(-sizes // BLOCK_T)  # blocks of each slot present
    num_blocks = int(per_slot.sum())
    token_capacity = len(token_slots) if token_capacity is None else token_capacity
    block_capacity = num_blocks if block_capacity is None else block_capacity
    assert len(order) <= token_capacity and num_blocks <= block_capacity
    packed = np.zeros(token_capacity + 3 * block_capacity, dtype=np.int64)
    packed[: len(order)] = order
    table = packed[token_capacity:].reshape(3, block_capacity)
    owner = np.repeat(np.arange(len(present)), per_slot)  # each block's slot, as an index
    within = np.arange(num_blocks) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
    table[0, :num_blocks] = present[owner]
    table[1, :num_blocks] = firsts[owner] + within * BLOCK_T
    table[2, :num_blocks] = np.minimum(BLOCK_T, sizes[owner] - within * BLOCK_T)
    return packed, num_blocks


def split_blocks(packed: torch.Tensor, token_capacity: int, block_capacity: int,
                 num_blocks: int | None = None) -> BlockTable:
    """Views of a packed block table (on the device): its sorted tokens and its first
    `num_blocks` blocks (default: all)."""
    blocks = block_capacity if num_blocks is None else num_blocks
    table = packed[token_capacity:].view(3, block_capacity)
    return packed[:token_capacity], table[0, :blocks], table[1, :blocks], table[2, :blocks]


@triton.jit
def _block_tokens(order_ptr, block_slot_ptr, block_start_ptr, block_len_ptr,
                  BLOCK_T: tl.constexpr):
    """This program's block: its slot, its first index into the sorted tokens, its token
    count, which of its BLOCK_T lanes hold a token, and those tokens."""
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block)
    start = tl.load(block_start_ptr + block)
    count = tl.load(block_len_ptr + block)
    t_mask = tl.arange(0, BLOCK_T) < count
    tokens = tl.load(order_ptr + start + tl.arange(0, BLOCK_T), mask=t_mask, other=0)
    return slot, start, count, t_mask, tokens


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, block_slot_ptr, block_start_ptr,
                   block_len_ptr, K, R, K_PER_SPLIT, stride_xt, stride_as, stride_ar,
                   stride_ht, DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    slot, start, count, t_mask, tokens = _block_tokens(order_ptr, block_slot_ptr,
                                                       block_start_ptr, block_len_ptr, BLOCK_T)
    if count == 0:
        return
    t = tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    k_first = tl.program_id(1) * K_PER_SPLIT
    for k0 in range(k_first, min(k_first + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=DOT_PRECISION)
    dst = h_ptr + (start + t)[:, None] * stride_ht + r[None, :]
    mask = t_mask[:, None] & r_mask[None, :]
    if SPLIT:
        tl.atomic_add(dst, acc, mask=mask)
    else:
        tl.store(dst, acc, mask=mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, order_ptr, block_slot_ptr, block_start_ptr,
                   block_len_ptr, N, R, stride_ht, stride_bs, stride_bn, stride_ot,
                   DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    slot, start, count, t_mask, tokens = _block_tokens(order_ptr, block_slot_ptr,
                                                       block_start_ptr, block_len_ptr, BLOCK_T)
    if count == 0:
        return
    t = tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    h = tl.load(h_ptr + (start + t)[:, None] * stride_ht + r[None, :],
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
                       blocks: BlockTable, block_n: int = 64) -> None:
    """out[tokens] += (x[tokens] @ a[slot].T) @ b[slot].T per block of `blocks`
    (`split_blocks`), in place. x [T, K], out [T, N], a [slots, R, K], b [slots, N, R];
    unit last strides."""
    order, block_slot, block_start, block_len = blocks
    num_blocks = block_slot.shape[0]
    if num_blocks == 0:
        return
    k, rank, n = x.shape[1], a.shape[1], b.shape[1]
    assert a.shape[2] == k and b.shape[2] == rank and out.shape[1] == n
    assert x.stride(1) == a.stride(2) == b.stride(2) == out.stride(1) == 1
    block_r = max(16, next_power_of_2(rank))
    # float32 models (the oracle tests) multiply in full precision, not TF32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # A block's shrink is a long loop over K on one program while few blocks fill few SMs:
    # split K over programs adding into h.
    splits = min(SHRINK_MAX_SPLITS, cdiv(k, SHRINK_K_PER_SPLIT))
    k_per_split = cdiv(cdiv(k, splits), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    h = (torch.zeros if splits > 1 else torch.empty)(order.shape[0], rank, dtype=torch.float32,
                                                     device=x.device)
    _launch_shrink((num_blocks, cdiv(k, k_per_split)), x, a, h, order, block_slot, block_start,
                   block_len, k, rank, k_per_split, x.stride(0), a.stride(0), a.stride(1),
                   h.stride(0), DOT_PRECISION=precision, BLOCK_T=BLOCK_T, BLOCK_R=block_r,
                   BLOCK_K=SHRINK_BLOCK_K, SPLIT=splits > 1)
    _launch_expand((num_blocks, cdiv(n, block_n)), h, b, out, order, block_slot, block_start,
                   block_len, n, rank, h.stride(0), b.stride(0), b.stride(1), out.stride(0),
                   DOT_PRECISION=precision, BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_N=block_n)
