"""A step's logit edits (penalties, logit bias, bad-word bans, min_p) in two kernels, in place
of the torch references' many small launches (`minisgl_backend.engine.controls.EDITS`), each
of which costs the engine's host thread about as much as a small model's decode step can spare:

* `apply_edits`: programs over (row, vocabulary chunk). Each writes its chunk to the output
  (which may be a copy: the raw logits then stay for log-probabilities) with the row's
  penalties, sparse or dense:
  - sparse, for rows of at most `SPARSE_POSITIONS` tokens so far: only tokens a row has seen
    change, and its token pool row holds them all, so the program gathers and scatters just
    those ids of its chunk (repeated ids write the same value);
  - dense, for longer rows: the chunk read once with the row's counts and prompt mask.
  Then it adds the row's bias entries, sets to -inf the last token of every bad-word sequence
  whose prefix ends the row so far, and for a min_p row writes the chunk's largest logit.
* then, for min_p rows, the floor (`kernels.sampling.MinPFloor`: logits below the row's
  largest plus temperature x log(min_p) become -inf), written by `apply_min_p_floor` or left to
  the sampling kernels, which apply it as they read the logits.

The arithmetic is the torch references' (penalties and the min_p compare in float32, bias
values rounded to the logits' dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2
from kernels.sampling import MinPFloor, apply_min_p_floor

# Bits of a program row's flags: which edits it applies; in the order the kernel applies them,
# which is `minisgl_backend.engine.controls.EDITS`' (the torch references').
PENALTIES, BIAS, BANS, MIN_P = 1, 2, 4, 8
EDIT_FLAGS = (PENALTIES, BIAS, BANS, MIN_P)
# Columns of a program row's float32 factors.
REPETITION, PRESENCE, FREQUENCY, MIN_P_OFFSET = 0, 1, 2, 3
FACTORS = 4
CHUNK = 4096  # vocabulary entries per program (a power of two)
# Rows with at most this many tokens so far take the sparse penalties (a power of two: the
# block of pool positions a program reads; each program of the row reads them from L2).
SPARSE_POSITIONS = 2048
# The same, as the kernels read them.
_PENALTIES, _BIAS, _BANS, _MIN_P = (tl.constexpr(bit) for bit in (PENALTIES, BIAS, BANS, MIN_P))
_REPETITION, _PRESENCE, _FREQUENCY, _MIN_P_OFFSET, _FACTORS = (
    tl.constexpr(col) for col in (REPETITION, PRESENCE, FREQUENCY, MIN_P_OFFSET, FACTORS))


@dataclass
class EditTables:
    """The engine's device state the edits read, per table row (None: no row uses it)."""

    counts: torch.Tensor | None  # [rows, vocab] int32: output tokens generated
    in_prompt: torch.Tensor | None  # [rows, vocab] uint8 (the bool mask's bytes): prompt tokens
    bias: tuple[torch.Tensor, torch.Tensor] | None  # ids [rows, width] int64, values float32
    bans: torch.Tensor | None  # [rows, sequences, length] int64, right-aligned, -1 padded
    token_pool: torch.Tensor  # [rows, positions] int32: each row's tokens so far


def min_p_scratch(rows: int, vocab: int, device: torch.device, chunk: int = CHUNK
                  ) -> torch.Tensor:
    """`MinPFloor.chunk_max` of `rows` program rows: each chunk's largest edited logit."""
    return torch.empty(rows, cdiv(vocab, chunk), dtype=torch.float32, device=device)


@triton.jit
def _penalize(x, seen, count, factors):
    """Logits `x` (their dtype) with the row's penalties: HF's repetition penalty on `seen`
    tokens (positive logits divided by it, negative ones multiplied), then
    `frequency * count + presence * (count > 0)` subtracted, in float32."""
    y = x.to(tl.float32)
    rep = tl.load(factors + _REPETITION)
    y = tl.where(seen, tl.where(y > 0, y / rep, y * rep), y)
    y = y - tl.load(factors + _FREQUENCY) * count.to(tl.float32) \
        - tl.load(factors + _PRESENCE) * (count > 0).to(tl.float32)
    return y.to(x.dtype)


@triton.jit
def _edit_kernel(src_ptr, src_stride, dst_ptr, dst_stride, program_rows_ptr, num_programs,
                 table_rows_ptr, next_pos_ptr, factors_ptr, counts_ptr, in_prompt_ptr,
                 state_stride, bias_ids_ptr, bias_values_ptr, bias_stride, bias_width, ban_ptr,
                 ban_row_stride, ban_seqs, ban_len, pool_ptr, pool_stride, max_ptr, num_chunks,
                 vocab, sparse_limit, COPY: tl.constexpr, HAS_PENALTIES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_BANS: tl.constexpr, HAS_MIN_P: tl.constexpr,
                 CHUNK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    # program_rows: [2, num_programs] int64, the batch index and the flags of each program row
    b = tl.load(program_rows_ptr + i)
    flags = tl.load(program_rows_ptr + num_programs + i)
    r = tl.load(table_rows_ptr + b).to(tl.int64)
    start = chunk * CHUNK_SIZE
    cols = start + tl.arange(0, CHUNK_SIZE)
    inside = cols < vocab
    row = dst_ptr + b * dst_stride
    penalized = ((flags & _PENALTIES) != 0) & HAS_PENALTIES
    seen_so_far = tl.load(next_pos_ptr + b).to(tl.int64)  # the row's tokens: pool[:next]
    sparse = seen_so_far <= sparse_limit
    factors = factors_ptr + i * _FACTORS
    dense_penalties = penalized & (seen_so_far > sparse_limit)
    if dense_penalties | COPY:  # the dense pass: every logit of the chunk read once, written once
        x = tl.load(src_ptr + b * src_stride + cols, mask=inside)
        if dense_penalties:
            count = tl.load(counts_ptr + r * state_stride + cols, mask=inside, other=0)
            seen = (count > 0) | (tl.load(in_prompt_ptr + r * state_stride + cols,
                                          mask=inside, other=0) != 0)
            x = _penalize(x, seen, count, factors)
        tl.store(row + cols, x, mask=inside)
    if HAS_PENALTIES:  # noqa: SIM102 - a constexpr test: the block compiles in only if used
        if penalized & sparse:
            p = tl.arange(0, BLOCK_P)
            ids = tl.load(pool_ptr + r * pool_stride + p, mask=p < seen_so_far, other=-1)
            mine = (ids >= start) & (ids < start + CHUNK_SIZE)
            x = tl.load(src_ptr + b * src_stride + ids, mask=mine)
            count = tl.load(counts_ptr + r * state_stride + ids, mask=mine, other=0)
            x = _penalize(x, mine, count, factors)
            # Every gather before any scatter: in place, a repeated id must read the raw
            # logit; and a copy's dense pass stores first.
            tl.debug_barrier()
            tl.store(row + ids, x, mask=mine)
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test: the block compiles in only if used
        if (flags & _BIAS) != 0:
            tl.debug_barrier()  # the dense pass's stores first
            w = tl.arange(0, BLOCK_W)
            ids = tl.load(bias_ids_ptr + r * bias_stride + w, mask=w < bias_width, other=0)
            values = tl.load(bias_values_ptr + r * bias_stride + w, mask=w < bias_width,
                             other=0.0)
            # Padding entries (id 0, value 0) change nothing: leave them out, so that they
            # never race with a real entry of id 0.
            mine = (w < bias_width) & (values != 0.0) & (ids >= start) & (ids < start + CHUNK_SIZE)
            y = tl.load(row + ids, mask=mine, other=0.0).to(tl.float32)
            value = values.to(dst_ptr.dtype.element_ty).to(tl.float32)
            tl.store(row + ids, (y + value).to(dst_ptr.dtype.element_ty), mask=mine)
    if HAS_BANS:  # noqa: SIM102 - a constexpr test: the block compiles in only if used
        if (flags & _BANS) != 0:
            tl.debug_barrier()  # a ban of a token comes after its bias
            s = tl.arange(0, BLOCK_S)[:, None]
            j = tl.arange(0, BLOCK_L)[None, :]
            table = tl.load(ban_ptr + r * ban_row_stride + s * ban_len + j,
                            mask=(s < ban_seqs) & (j < ban_len), other=-1)
            # Column j < ban_len - 1 of a sequence must equal the token at position
            # next - (ban_len - 1) + j (-1: a shorter sequence, matches anything).
            pos = seen_so_far - (ban_len - 1) + j
            context = tl.load(pool_ptr + r * pool_stride + pos,
                              mask=(pos >= 0) & (j < ban_len - 1), other=-2).to(tl.int64)
            prefix_ok = (table == context) | (table < 0) | (j >= ban_len - 1)
            hit = tl.min(prefix_ok.to(tl.int32), axis=1) > 0  # [BLOCK_S]
            last = tl.sum(tl.where(j == ban_len - 1, table, 0), axis=1)
            ban = hit & (last >= start) & (last < start + CHUNK_SIZE) \
                & (tl.arange(0, BLOCK_S) < ban_seqs)
            minus_inf = tl.full([BLOCK_S], float("-inf"), tl.float32)
            tl.store(row + tl.maximum(last, 0), minus_inf.to(dst_ptr.dtype.element_ty),
                     mask=ban)
    if HAS_MIN_P:  # noqa: SIM102 - a constexpr test: the block compiles in only if used
        if (flags & _MIN_P) != 0:
            tl.debug_barrier()  # the chunk as edited
            y = tl.load(row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            tl.store(max_ptr + i * num_chunks + chunk, tl.max(y, 0))


_launch_edits = DirectLaunch(_edit_kernel)


def apply_edits(logits: torch.Tensor, out: torch.Tensor, program_rows: torch.Tensor,
                table_rows: torch.Tensor, next_positions: torch.Tensor, factors: torch.Tensor,
                tables: EditTables, flags: int, chunk: int = CHUNK,
                min_p: MinPFloor | None = None, floor: bool = True,
                sparse_limit: int = SPARSE_POSITIONS) -> None:
    """Edit rows of `logits` [bs, vocab] (unit stride along the vocabulary) into `out` (the
    same tensor: in place; another of its shape: a copy, and every program row is written).

    `program_rows` [2, m] int64: each program row's batch index and flags (bits PENALTIES,
    BIAS, BANS, MIN_P); `factors` [m, FACTORS] float32: its repetition, presence and frequency
    penalties and min_p offset. `table_rows` and `next_positions` [bs] (device): each batch
    entry's table row and the position of the token it samples. `flags`: the union of the
    rows' flags (the kernels compile in only what some row uses). `chunk`: vocabulary entries
    per program (a power of two). `min_p`: with a min_p row, its floor's state, whose chunk
    maxima [m, vocabulary chunks] (`min_p_scratch`) are written here; `floor`: set the logits
    below it to -inf (else the sampling kernels apply `min_p`). `sparse_limit`: rows with at
    most this many tokens so far (up to `SPARSE_POSITIONS`) take the sparse penalties, longer
    ones the dense."""
    m, vocab = program_rows.shape[1], logits.shape[1]
    if m == 0:
        return
    copy = out is not logits
    assert logits.stride(1) == 1 and out.stride(1) == 1
    assert 0 <= sparse_limit <= SPARSE_POSITIONS
    num_chunks = cdiv(vocab, chunk)
    pool = tables.token_pool
    counts, in_prompt = tables.counts, tables.in_prompt
    if not flags & PENALTIES or counts is None or in_prompt is None:
        counts, in_prompt = pool, pool  # never read
    else:
        assert counts.stride(0) == in_prompt.stride(0) and counts.stride(1) == 1
        assert in_prompt.dtype == torch.uint8
    ids, values = tables.bias if flags & BIAS and tables.bias is not None else (pool, pool)
    width = ids.shape[1] if flags & BIAS else 1
    bans = tables.bans if flags & BANS and tables.bans is not None else pool
    seqs, length = (bans.shape[1], bans.shape[2]) if flags & BANS else (1, 1)
    chunk_max = factors  # never written without a min_p row
    if flags & MIN_P:
        assert min_p is not None and min_p.chunk_max.shape == (m, num_chunks)
        chunk_max = min_p.chunk_max
    _launch_edits((m, num_chunks),
        logits, logits.stride(0), out, out.stride(0), program_rows, m,
        table_rows, next_positions, factors, counts, in_prompt, counts.stride(0),
        ids, values, ids.stride(0), width, bans, bans.stride(0), seqs, length,
        pool, pool.stride(0), chunk_max, num_chunks, vocab, sparse_limit,
        COPY=copy, HAS_PENALTIES=bool(flags & PENALTIES), HAS_BIAS=bool(flags & BIAS),
        HAS_BANS=bool(flags & BANS), HAS_MIN_P=bool(flags & MIN_P), CHUNK_SIZE=chunk,
        BLOCK_W=next_power_of_2(width), BLOCK_S=next_power_of_2(seqs),
        BLOCK_L=next_power_of_2(length), BLOCK_P=max(16, next_power_of_2(sparse_limit)),
        num_warps=4)
    if flags & MIN_P and floor:
        apply_min_p_floor(out, min_p, chunk)
