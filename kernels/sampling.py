"""Temperature sampling (and greedy rows) straight from the logits, in two small kernels.

The torch sampler (`minisgl_backend.engine.sampler`) makes several passes over the whole
[batch, vocab] logits; here they are read once, plus one chunk per row:

1. grid (rows, chunks): per chunk of the vocabulary, the largest scaled logit, the first index
   holding it, and the sum of exp(scaled - chunk max);
2. grid (rows,): the row's total mass from the chunk sums, the chunk where the cumulative mass
   passes `uniform * total`, then a scan of that chunk alone for the first token past it.

That is the inverse-CDF rule in token-id order of the torch path (float rounding may move a
pick that lies within rounding of a boundary). Greedy rows, whose temperature is 0 (decided at
admission: `core.RowSampling`), take the first index of the largest logit (torch.argmax's tie
rule). Top-k / top-p rows are not handled here: they need the sorted path.

min_p's floor (`MinPFloor`, left by `kernels.logit_edits`) is applied as the kernels read the
logits; `apply_min_p_floor` writes it into the logits for the other paths (argmax, torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2

# `minisgl_backend.engine.sampler.seeded_uniform`'s constants as int64 (its multipliers as
# their residues below 2**31, so that no product overflows).
_MASK32 = tl.constexpr(0xFFFFFFFF)
_GOLDEN = tl.constexpr(0x9E3779B9)
_MIX_M1 = tl.constexpr(0x85EBCA6B - (1 << 32))
_MIX_M2 = tl.constexpr(0xC2B2AE35 - (1 << 32))


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * _MIX_M1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _MIX_M2) & _MASK32
    return x ^ (x >> 16)


@triton.jit
def _seeded_uniform(seed, position):
    """`seeded_uniform(seed, position)` of one row (int64 scalars), bit for bit: float64."""
    mask = tl.full((), _MASK32, tl.int64)
    h = _mix32((seed & mask) ^ tl.full((), _GOLDEN, tl.int64))
    h = _mix32(h ^ ((seed >> 32) & mask))
    h = _mix32(h ^ (position & mask))
    h = _mix32(h ^ ((position >> 32) & mask))
    return (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)


@triton.jit
def _chunk_stats_kernel(logits_ptr, stride_row, temperature_ptr, max_ptr,
                        argmax_ptr, sum_ptr, vocab, num_chunks, floor_rows_ptr, floor_max_ptr,
                        floor_offset_ptr, floor_offset_stride, floor_chunks,
                        CHUNK: tl.constexpr, MIN_P: tl.constexpr,
                        FLOOR_CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    if MIN_P:
        x = _floored(x, _row_floor(floor_rows_ptr, floor_max_ptr, floor_offset_ptr,
                                   floor_offset_stride, floor_chunks, row, FLOOR_CHUNKS_P2))
    temperature = tl.load(temperature_ptr + row).to(tl.float32)  # stored in any precision
    if temperature > 0:  # not greedy; monotone: the argmax stays where it is
        x = x / temperature
    chunk_max = tl.max(x, 0)
    # -inf entries (padding, masked stop ids) add nothing, also in an all -inf chunk.
    mass = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - chunk_max)), 0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, chunk_max)
    tl.store(argmax_ptr + out, tl.min(tl.where(x == chunk_max, cols, vocab), 0))
    tl.store(sum_ptr + out, mass)


@triton.jit
def row_chunk_max(max_ptr, row, num_chunks, CHUNKS_P2: tl.constexpr):
    """A row's chunk maxima (written per chunk by a first kernel): (chunk numbers padded to
    CHUNKS_P2, their maxima, -inf in the padding, and the row's max)."""
    chunks = tl.arange(0, CHUNKS_P2)
    chunk_max = tl.load(max_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                        other=float("-inf"))
    return chunks, chunk_max, tl.max(chunk_max, 0)


@triton.jit
def row_chunk_mass(sum_ptr, row, num_chunks, chunks, chunk_max, row_max):
    """Each chunk's sum of exp(x - chunk max), rescaled to the row's max (0 for a chunk of -inf
    only, and in the padding)."""
    mass = tl.load(sum_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0)
    return tl.where(chunk_max == float("-inf"), 0.0, mass * tl.exp(chunk_max - row_max))


@dataclass
class MinPFloor:
    """min_p's floor of a batch's rows, not yet applied to its logits: a logit below its
    row's largest logit (before grammar masks) plus the row's offset (temperature x
    log(min_p)) is dropped."""

    rows: torch.Tensor  # [bs] int64: each batch row's row of the two below, -1: no min_p
    chunk_max: torch.Tensor  # [m, chunks] float32: the largest logit of each vocabulary chunk
    offsets: torch.Tensor  # [m] float32 (any stride)

    @property
    def num_chunks(self) -> int:
        return self.chunk_max.shape[1]


@triton.jit
def _row_floor(floor_rows_ptr, floor_max_ptr, floor_offset_ptr, floor_offset_stride,
               floor_chunks, row, FLOOR_CHUNKS_P2: tl.constexpr):
    """A batch row's min_p floor (`MinPFloor`), -inf for a row without min_p."""
    i = tl.load(floor_rows_ptr + row)
    floor = tl.full((), float("-inf"), tl.float32)
    if i >= 0:
        _, _, row_max = row_chunk_max(floor_max_ptr, i, floor_chunks, FLOOR_CHUNKS_P2)
        floor = row_max + tl.load(floor_offset_ptr + i * floor_offset_stride)
    return floor


@triton.jit
def _floored(x, floor):
    """float32 logits `x` with those below `floor` set to -inf."""
    return tl.where(x < floor, float("-inf"), x)


@triton.jit
def _apply_floor_kernel(logits_ptr, stride_row, floor_rows_ptr, floor_max_ptr,
                        floor_offset_ptr, floor_offset_stride, floor_chunks, vocab,
                        CHUNK: tl.constexpr, FLOOR_CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(floor_rows_ptr + row) >= 0:
        floor = _row_floor(floor_rows_ptr, floor_max_ptr, floor_offset_ptr, floor_offset_stride,
                           floor_chunks, row, FLOOR_CHUNKS_P2)
        cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=0.0)
        # The whole chunk written back, kept logits too: a store masked per logit is not
        # vectorized.
        tl.store(logits_ptr + row * stride_row + cols,
                 _floored(x.to(tl.float32), floor).to(x.dtype), mask=cols < vocab)


@triton.jit
def _pick_kernel(logits_ptr, stride_row, temperature_ptr, uniform_ptr, seed_ptr,
                 position_ptr, max_ptr, argmax_ptr, sum_ptr, out_ptr, vocab, num_chunks,
                 floor_rows_ptr, floor_max_ptr, floor_offset_ptr, floor_offset_stride,
                 floor_chunks, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr,
                 HASHED: tl.constexpr, MIN_P: tl.constexpr, FLOOR_CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks, chunk_max, row_max = row_chunk_max(max_ptr, row, num_chunks, CHUNKS_P2)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature <= 0:  # greedy
        best = tl.min(tl.where(chunk_max == row_max, chunks, CHUNKS_P2), 0)
        tl.store(out_ptr + row, tl.load(argmax_ptr + row * num_chunks + best).to(tl.int64))
    else:
        mass = row_chunk_mass(sum_ptr, row, num_chunks, chunks, chunk_max, row_max)
        cdf = tl.cumsum(mass, 0)
        if HASHED:
            uniform = _seeded_uniform(tl.load(seed_ptr + row).to(tl.int64),
                                      tl.load(position_ptr + row).to(tl.int64))
        else:
            uniform = tl.load(uniform_ptr + row).to(tl.float64)
        target = (uniform * tl.sum(mass, 0).to(tl.float64)).to(tl.float32)
        # The chunk the target falls in; past the end (rounding): the last chunk with mass.
        chosen = tl.min(tl.where(cdf > target, chunks, CHUNKS_P2), 0)
        last = tl.max(tl.where(mass > 0, chunks, 0), 0)
        chosen = tl.where(chosen < num_chunks, chosen, last)
        before = tl.sum(tl.where(chunks < chosen, mass, 0.0), 0)
        cols = chosen * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab,
                    other=float("-inf")).to(tl.float32)
        if MIN_P:
            x = _floored(x, _row_floor(floor_rows_ptr, floor_max_ptr, floor_offset_ptr,
                                       floor_offset_stride, floor_chunks, row, FLOOR_CHUNKS_P2))
        x = x / temperature
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - row_max))
        token_cdf = before + tl.cumsum(p, 0)
        pick = tl.min(tl.where(token_cdf > target, cols, vocab), 0)
        # Rounding may leave the chunk's scan short of the target: its last token with mass.
        last_kept = tl.max(tl.where(p > 0, cols, 0), 0)
        tl.store(out_ptr + row, tl.where(pick < vocab, pick, last_kept).to(tl.int64))


_launch_chunk_stats = DirectLaunch(_chunk_stats_kernel)
_launch_pick = DirectLaunch(_pick_kernel)
_launch_apply_floor = DirectLaunch(_apply_floor_kernel)


def _floor_args(floor: MinPFloor | None, dummy: torch.Tensor) -> tuple:
    """The kernels' floor arguments (placeholders, never read, without a floor) and
    FLOOR_CHUNKS_P2."""
    if floor is None:
        return (dummy, dummy, dummy, 0, 1), 2
    assert floor.chunk_max.is_contiguous() and floor.chunk_max.dtype == torch.float32
    return ((floor.rows, floor.chunk_max, floor.offsets, floor.offsets.stride(0),
             floor.num_chunks), max(2, next_power_of_2(floor.num_chunks)))


def apply_min_p_floor(logits: torch.Tensor, floor: MinPFloor, chunk: int = 4096) -> None:
    """Set the logits [bs, vocab] (unit stride along the vocabulary) below their row's
    min_p floor to -inf, in place."""
    bs, vocab = logits.shape
    assert logits.stride(1) == 1
    if bs == 0:
        return
    args, chunks_p2 = _floor_args(floor, logits)
    _launch_apply_floor((bs, cdiv(vocab, chunk)),
        logits, logits.stride(0), *args, vocab, CHUNK=chunk, FLOOR_CHUNKS_P2=chunks_p2,
        num_warps=4)


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                       uniform: torch.Tensor | None = None, chunk: int = 4096, *,
                       seed: torch.Tensor | None = None,
                       position: torch.Tensor | None = None,
                       min_p: MinPFloor | None = None) -> torch.Tensor:
    """One token id per row of `logits` [bs, vocab] (int64 [bs]).

    temperature [bs] (any float dtype; 0: greedy), and the row's draw in (0, 1) for the
    inverse CDF: `uniform` [bs], or computed in the kernel as `seeded_uniform(seed, position)`
    of int64 `seed` and `position` [bs] (no host work a step). `chunk`: vocabulary entries per
    program (a power of two). `min_p`: the rows' min_p floor, applied as the logits are read
    (they stay as they are).
    """
    hashed = uniform is None
    if hashed == (seed is None or position is None):
        raise ValueError("sample_from_logits takes either uniform or seed and position")
    bs, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs == 0:
        return out
    num_chunks = cdiv(vocab, chunk)
    chunk_max = torch.empty(bs, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty_like(chunk_max)
    chunk_argmax = torch.empty(bs, num_chunks, dtype=torch.int32, device=logits.device)
    draws = (seed, position) if hashed else (uniform, uniform)
    temperature, *draws = (t.contiguous() for t in (temperature, *draws))
    floor_args, floor_chunks_p2 = _floor_args(min_p, chunk_max)
    _launch_chunk_stats((bs, num_chunks),
        logits, logits.stride(0), temperature, chunk_max, chunk_argmax, chunk_sum, vocab,
        num_chunks, *floor_args, CHUNK=chunk, MIN_P=min_p is not None,
        FLOOR_CHUNKS_P2=floor_chunks_p2, num_warps=4)
    _launch_pick((bs,),
        logits, logits.stride(0), temperature, draws[0], draws[0], draws[1], chunk_max,
        chunk_argmax, chunk_sum, out, vocab, num_chunks, *floor_args, CHUNK=chunk,
        CHUNKS_P2=max(2, next_power_of_2(num_chunks)), HASHED=hashed, MIN_P=min_p is not None,
        FLOOR_CHUNKS_P2=floor_chunks_p2, num_warps=4)
    return out
