"""Log-probability statistics of logits rows in two small kernels: the log-normalizer and the
most likely tokens, without a [rows, vocab] float32 log-softmax or torch.topk's radix passes
(about 0.17 ms of torch.topk alone per step at 64 rows of Qwen3's vocabulary).

1. grid (rows, chunks): per chunk of the vocabulary, its largest logit, the sum of
   exp(logit - that max), and its `K` largest logits with their ids (K rounds of "take the
   largest, lowest id first, and drop it");
2. grid (rows,): the row's logsumexp from the chunk sums, and its `top` largest logits among
   the chunks' candidates, in the same order.

A token's log-probability is then its logit minus the row's logsumexp, as
torch.log_softmax(dtype=float32) computes it (the sums may round differently).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling import row_chunk_mass, row_chunk_max


@triton.jit
def _chunk_top_kernel(logits_ptr, stride_row, max_ptr, sum_ptr, top_val_ptr, top_id_ptr, vocab,
                      num_chunks, CHUNK: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    chunk_max = tl.max(x, 0)
    mass = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - chunk_max)), 0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, chunk_max)
    tl.store(sum_ptr + out, mass)
    for j in tl.static_range(K):
        best = tl.max(x, 0)
        best_id = tl.min(tl.where(x == best, cols, 2147483647), 0)
        tl.store(top_val_ptr + out * K + j, best)
        tl.store(top_id_ptr + out * K + j, best_id)
        x = tl.where(cols == best_id, float("-inf"), x)


@triton.jit
def _row_top_kernel(max_ptr, sum_ptr, top_val_ptr, top_id_ptr, lse_ptr, out_val_ptr, out_id_ptr,
                    out_stride, num_chunks, top, K: tl.constexpr, CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks, chunk_max, row_max = row_chunk_max(max_ptr, row, num_chunks, CHUNKS_P2)
    mass = row_chunk_mass(sum_ptr, row, num_chunks, chunks, chunk_max, row_max)
    lse = row_max + tl.log(tl.sum(mass, 0))
    tl.store(lse_ptr + row, lse)
    # The chunks' candidates: CHUNKS_P2 * K of them, row by row of the [chunks, K] tables.
    slots = tl.arange(0, CHUNKS_P2 * K)
    ok = slots < num_chunks * K
    cand = tl.load(top_val_ptr + row * num_chunks * K + slots, mask=ok, other=float("-inf"))
    ids = tl.load(top_id_ptr + row * num_chunks * K + slots, mask=ok, other=2147483647)
    for j in tl.static_range(K):
        best = tl.max(cand, 0)
        best_id = tl.min(tl.where(cand == best, ids, 2147483647), 0)
        if j < top:
            tl.store(out_val_ptr + row * out_stride + j, best - lse)
            tl.store(out_id_ptr + row * out_stride + j, best_id)
        cand = tl.where(ids == best_id, float("-inf"), cand)


def logprob_stats(logits: torch.Tensor, top: int, chunk: int = 4096,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of `logits` [rows, vocab] (any float dtype): each row's logsumexp (float32 [rows]) and
    its `top` most likely tokens' log-probabilities (float32 [rows, top], descending; equal
    ones lowest id first) and ids (int32 [rows, top]: what the step's reply carries). `out`:
    where to write the last two (views with one row stride and unit column stride, e.g.
    columns of one table)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    if out is None:
        top_lp = torch.empty(rows, top, dtype=torch.float32, device=device)
        top_ids = torch.empty(rows, top, dtype=torch.int32, device=device)
    else:
        top_lp, top_ids = out
        assert top_lp.dtype == torch.float32 and top_ids.dtype == torch.int32
        assert top_lp.shape == top_ids.shape == (rows, top)
        assert top_lp.stride() == top_ids.stride() and (top <= 1 or top_lp.stride(1) == 1)
    if rows == 0:
        return lse, top_lp, top_ids
    k = triton.next_power_of_2(max(top, 1))
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty_like(chunk_max)
    cand_val = torch.empty(rows, num_chunks, k, dtype=torch.float32, device=device)
    cand_id = torch.empty(rows, num_chunks, k, dtype=torch.int32, device=device)
    _chunk_top_kernel[(rows, num_chunks)](
        logits, logits.stride(0), chunk_max, chunk_sum, cand_val, cand_id, vocab, num_chunks,
        CHUNK=chunk, K=k, num_warps=4)
    _row_top_kernel[(rows,)](
        chunk_max, chunk_sum, cand_val, cand_id, lse, top_lp, top_ids, top_lp.stride(0),
        num_chunks, top, K=k, CHUNKS_P2=max(2, triton.next_power_of_2(num_chunks)),
        num_warps=4)
    return lse, top_lp, top_ids
