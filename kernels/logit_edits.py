"""Logit bias, bad-word bans and min_p applied to a step's logits, one kernel each group.

The torch path (`minisgl_backend.engine.controls`) spends about twenty small kernels a step on
these: gathers of each row's tables, the bad-word context compare, scatters, and min_p's
max/compare/fill. A decode step of a small model is a few of those long, so here:

* `apply_sparse_edits`: one program per row adds the row's bias entries, then sets the last
  token of every bad-word sequence whose prefix ends the row so far to -inf (the context is
  read from the engine's token pool, as the torch path does);
* `apply_min_p`: programs over (row, vocabulary chunk) find each chunk's largest logit, then
  drop every logit below the row's `max + offset` (offset = temperature x log(min_p)) to
  -inf: a program per row looping over the vocabulary waited on its loads about 75 us.

The arithmetic is the torch path's: bias values are added in the logits' dtype, min_p compares
in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling import row_chunk_max


@triton.jit
def _sparse_edits_kernel(logits_ptr, logits_stride, batch_rows_ptr, table_rows_ptr,
                         next_pos_ptr, bias_ids_ptr, bias_values_ptr, bias_stride, bias_width,
                         ban_ptr, ban_row_stride, ban_seqs, ban_len, pool_ptr, pool_stride,
                         HAS_BIAS: tl.constexpr, HAS_BANS: tl.constexpr,
                         BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_L: tl.constexpr):
    i = tl.program_id(0)
    b = tl.load(batch_rows_ptr + i).to(tl.int64)
    r = tl.load(table_rows_ptr + i).to(tl.int64)
    row = logits_ptr + b * logits_stride
    if HAS_BIAS:
        w = tl.arange(0, BLOCK_W)
        ids = tl.load(bias_ids_ptr + r * bias_stride + w, mask=w < bias_width, other=0)
        values = tl.load(bias_values_ptr + r * bias_stride + w, mask=w < bias_width, other=0.0)
        # Padding entries (id 0, value 0) change nothing: leave them out, so that they never
        # race with a real entry of id 0.
        real = (w < bias_width) & (values != 0.0)
        x = tl.load(row + ids, mask=real, other=0.0).to(tl.float32)
        # The value rounded to the logits' dtype first, as the torch path adds it.
        value = values.to(logits_ptr.dtype.element_ty).to(tl.float32)
        tl.store(row + ids, (x + value).to(logits_ptr.dtype.element_ty), mask=real)
        tl.debug_barrier()  # a ban of the same token comes after its bias
    if HAS_BANS:
        s = tl.arange(0, BLOCK_S)[:, None]
        j = tl.arange(0, BLOCK_L)[None, :]
        inside = (s < ban_seqs) & (j < ban_len)
        table = tl.load(ban_ptr + r * ban_row_stride + s * ban_len + j, mask=inside, other=-1)
        # Column j < ban_len - 1 of a sequence must equal the token at position
        # next - (ban_len - 1) + j (-1: a shorter sequence, matches anything).
        next_pos = tl.load(next_pos_ptr + i).to(tl.int64)
        pos = next_pos - (ban_len - 1) + j
        context = tl.load(pool_ptr + r * pool_stride + pos, mask=(pos >= 0) & (j < ban_len - 1),
                          other=-2).to(tl.int64)
        prefix_ok = (table == context) | (table < 0) | (j >= ban_len - 1)
        hit = tl.min(prefix_ok.to(tl.int32), axis=1) > 0  # [BLOCK_S]
        last = tl.sum(tl.where(j == ban_len - 1, table, 0), axis=1)
        ban = hit & (last >= 0) & (tl.arange(0, BLOCK_S) < ban_seqs)
        minus_inf = tl.full([BLOCK_S], float("-inf"), tl.float32)
        tl.store(row + tl.maximum(last, 0), minus_inf.to(logits_ptr.dtype.element_ty), mask=ban)


def apply_sparse_edits(logits: torch.Tensor, batch_rows: torch.Tensor,
                       table_rows: torch.Tensor, next_positions: torch.Tensor,
                       bias: tuple[torch.Tensor, torch.Tensor] | None,
                       bans: torch.Tensor | None, token_pool: torch.Tensor) -> None:
    """Rows `batch_rows` of `logits` [bs, vocab] (in place, unit stride along the vocabulary),
    whose engine table rows are `table_rows` and whose sampled tokens sit at `next_positions`
    (one per edited row): add `bias` = (ids [rows, width] int64, values [rows, width]
    float32; padding id 0 with 0.0), then ban with `bans` [rows, sequences, length] int64
    (right-aligned, -1 padded) against `token_pool` [rows, positions] int32."""
    m = len(batch_rows)
    if m == 0 or (bias is None and bans is None):
        return
    assert logits.stride(1) == 1 and token_pool.stride(1) == 1
    ids, values = bias if bias is not None else (token_pool, token_pool)  # unused if None
    width = ids.shape[1] if bias is not None else 1
    ban = bans if bans is not None else token_pool
    seqs, length = (bans.shape[1], bans.shape[2]) if bans is not None else (1, 1)
    if bans is not None:
        assert bans.is_contiguous()
    _sparse_edits_kernel[(m,)](
        logits, logits.stride(0), batch_rows.contiguous(), table_rows.contiguous(),
        next_positions.contiguous(), ids, values, ids.stride(0), width,
        ban, ban.stride(0), seqs, length, token_pool, token_pool.stride(0),
        HAS_BIAS=bias is not None, HAS_BANS=bans is not None,
        BLOCK_W=triton.next_power_of_2(width), BLOCK_S=triton.next_power_of_2(seqs),
        BLOCK_L=triton.next_power_of_2(length), num_warps=1)


@triton.jit
def _min_p_chunk_max_kernel(logits_ptr, logits_stride, batch_rows_ptr, max_ptr, vocab,
                            num_chunks, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = logits_ptr + tl.load(batch_rows_ptr + i).to(tl.int64) * logits_stride
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    tl.store(max_ptr + i * num_chunks + chunk, tl.max(x, 0))


@triton.jit
def _min_p_floor_kernel(logits_ptr, logits_stride, batch_rows_ptr, offsets_ptr, max_ptr, vocab,
                        num_chunks, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = logits_ptr + tl.load(batch_rows_ptr + i).to(tl.int64) * logits_stride
    _, _, row_max = row_chunk_max(max_ptr, i, num_chunks, CHUNKS_P2)
    floor = row_max + tl.load(offsets_ptr + i)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(row + cols, mask=cols < vocab, other=0.0)
    minus_inf = tl.full([CHUNK], float("-inf"), tl.float32)
    dropped = (cols < vocab) & (x.to(tl.float32) < floor)
    tl.store(row + cols, minus_inf.to(x.dtype), mask=dropped)


def apply_min_p(logits: torch.Tensor, batch_rows: torch.Tensor, offsets: torch.Tensor,
                chunk: int = 4096) -> None:
    """min_p on rows `batch_rows` of `logits` [bs, vocab] (in place, unit stride along the
    vocabulary): a logit below the row's largest plus `offsets` (float32, one per row:
    temperature x log(min_p)) becomes -inf. `chunk`: vocabulary entries per program (a
    power of two)."""
    m, vocab = len(batch_rows), logits.shape[1]
    if m == 0:
        return
    assert logits.stride(1) == 1
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty(m, num_chunks, dtype=torch.float32, device=logits.device)
    batch_rows = batch_rows.contiguous()
    _min_p_chunk_max_kernel[(m, num_chunks)](logits, logits.stride(0), batch_rows, chunk_max,
                                             vocab, num_chunks, CHUNK=chunk, num_warps=4)
    _min_p_floor_kernel[(m, num_chunks)](
        logits, logits.stride(0), batch_rows, offsets.contiguous(), chunk_max, vocab,
        num_chunks, CHUNK=chunk, CHUNKS_P2=max(2, triton.next_power_of_2(num_chunks)),
        num_warps=4)
