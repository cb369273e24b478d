"""Group a MoE layer's (token, slot) pairs by expert, in blocks of BLOCK_M rows, on the device.

Pair p = token * top_k + slot is routed to expert topk_ids.flatten()[p]. The output lists every
pair once, sorted by expert (ascending pair order inside an expert), with each expert's group
padded to a multiple of BLOCK_M by a sentinel (= the number of pairs), so every block of BLOCK_M
entries belongs to one expert. Three kernels, none of which talks to the host:
  count,   grid (chunks,): how many pairs of each chunk of BLOCK_C pairs go to each expert;
  offsets, grid (1,): per-chunk prefix counts, group starts, the valid padded length, each
    block's expert, and the sentinels (group padding and the unused tail of the buffer);
  scatter, grid (chunks,): each pair's rank among its chunk's pairs of the same expert, hence
    its place in the sorted list.
Output sizes depend only on (pairs, experts, BLOCK_M), never on the routing, so the step can be
captured in a CUDA graph and replayed with new routing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Elements of the [chunk, experts] one-hot tile that one program holds: bounds registers.
_TILE = 8192


class BlockAlignment(NamedTuple):
    sorted_pair_ids: torch.Tensor  # [capacity] int32; padding and tail = num pairs (sentinel)
    expert_ids: torch.Tensor  # [capacity // block_m] int32, each in [0, num_experts)
    num_padded: torch.Tensor  # [1] int32: entries in use, a multiple of block_m
    block_m: int


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: at most min(experts, pairs) groups are non-empty, each
    padded by at most block_m - 1; the length is a multiple of block_m, so round down."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    p = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    hits = (ids[:, None] == e[None, :]).to(tl.int32)
    tl.store(counts_ptr + chunk * NUM_EXPERTS + e, tl.sum(hits, 0), mask=e < NUM_EXPERTS)


@triton.jit
def _offsets_kernel(counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                    num_pairs, num_chunks, capacity,
                    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    ROWS: tl.constexpr, TAIL: tl.constexpr):
    """counts_ptr holds [num_chunks + 1, NUM_EXPERTS]: per-chunk counts on entry, rewritten to
    each chunk's first rank within its expert; the extra row receives the group starts."""
    e = tl.arange(0, BLOCK_E)
    e_mask = e < NUM_EXPERTS
    totals = tl.zeros([BLOCK_E], tl.int32)
    # ROWS chunks at a time, so the serial loop stays short for long prefills.
    for c0 in range(0, num_chunks, ROWS):
        c = c0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + c[:, None] * NUM_EXPERTS + e[None, :]
        mask = (c < num_chunks)[:, None] & e_mask[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, 0) - counts + totals[None, :], mask=mask)
        totals += tl.sum(counts, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(counts_ptr + num_chunks * NUM_EXPERTS + e, starts, mask=e_mask)
    num_padded = tl.sum(padded, 0)
    tl.store(num_padded_ptr, num_padded)

    # Sentinels after each group's pairs (fewer than BLOCK_M), then after the last group.
    j = tl.arange(0, BLOCK_M)
    pad_pos = (starts + totals)[:, None] + j[None, :]
    sentinel = tl.zeros([BLOCK_E, BLOCK_M], tl.int32) + num_pairs
    tl.store(sorted_ptr + pad_pos, sentinel, mask=e_mask[:, None] & (pad_pos < ends[:, None]))
    for t0 in range(num_padded, capacity, TAIL):
        t = t0 + tl.arange(0, TAIL)
        tl.store(sorted_ptr + t, tl.zeros([TAIL], tl.int32) + num_pairs, mask=t < capacity)

    # A block's expert is the number of groups ending at or before its first row. Blocks past
    # num_padded are never computed; they get the last expert, so every id stays in range.
    for b0 in range(0, capacity // BLOCK_M, ROWS):
        b = b0 + tl.arange(0, ROWS)
        done = (ends[None, :] <= (b * BLOCK_M)[:, None]) & e_mask[None, :]
        owner = tl.minimum(tl.sum(done.to(tl.int32), 1), NUM_EXPERTS - 1)
        tl.store(expert_ids_ptr + b, owner, mask=b < capacity // BLOCK_M)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, num_pairs, num_chunks,
                    NUM_EXPERTS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    p = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    valid = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=valid, other=-1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    hits = (ids[:, None] == e[None, :]).to(tl.int32)
    # Same-expert pairs before p in this chunk: the running count at p's own expert, minus p.
    rank = tl.sum(hits * tl.cumsum(hits, 0), 1) - 1
    first = tl.load(counts_ptr + chunk * NUM_EXPERTS + ids, mask=valid, other=0)
    start = tl.load(counts_ptr + num_chunks * NUM_EXPERTS + ids, mask=valid, other=0)
    tl.store(sorted_ptr + start + first + rank, p, mask=valid)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort the pairs of `topk_ids` [tokens, top_k] (any integer dtype, ids in
    [0, num_experts)) by expert in blocks of `block_m` (a power of two); see the module doc.

    Sizes: `padded_capacity(tokens * top_k, num_experts, block_m)` entries and that many
    / block_m blocks. Only the first num_padded entries (and num_padded / block_m blocks) are
    in use; the rest hold the sentinel and the last expert id."""
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m {block_m}: not a power of 2"
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)  # the offsets kernel writes it
    if num_pairs == 0:
        return BlockAlignment(sorted_ids, expert_ids, num_padded.zero_(), block_m)
    block_e = triton.next_power_of_2(num_experts)
    block_c = max(16, min(_TILE // block_e, triton.next_power_of_2(num_pairs)))
    num_chunks = triton.cdiv(num_pairs, block_c)
    counts = torch.empty((num_chunks + 1) * num_experts, dtype=torch.int32, device=dev)
    warps = 8 if block_c * block_e >= 4096 else 4
    _count_kernel[(num_chunks,)](ids, counts, num_pairs, NUM_EXPERTS=num_experts,
                                 BLOCK_C=block_c, BLOCK_E=block_e, num_warps=warps)
    _offsets_kernel[(1,)](counts, sorted_ids, expert_ids, num_padded,
                          num_pairs, num_chunks, capacity,
                          NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=block_e,
                          ROWS=max(1, 4096 // block_e), TAIL=1024, num_warps=4)
    _scatter_kernel[(num_chunks,)](ids, counts, sorted_ids, num_pairs, num_chunks,
                                   NUM_EXPERTS=num_experts, BLOCK_C=block_c, BLOCK_E=block_e,
                                   num_warps=warps)
    return BlockAlignment(sorted_ids, expert_ids, num_padded, block_m)
