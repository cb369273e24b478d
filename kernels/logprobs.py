"""Log-probability statistics of logits rows in two small kernels: the log-normalizer and the
most likely tokens, without a [rows, vocab] float32 log-softmax or torch.topk's radix passes.

Each logit and its id are packed into one int64 key (`_order_key`) whose integer order is "larger
logit first, then lower id", so one max reduction takes the next most likely token (two, a
value's and an id's, without the packing):

1. grid (rows, chunks): per chunk of the vocabulary, its largest logit, the sum of
   exp(logit - that max), and the keys of its `top` largest logits: `top` rounds of "take the
   largest key, and drop it" over the keys of its groups of 32 logits (each group's largest
   logit and its number) pick the `top` groups that hold them, then `top` rounds over those
   groups' logits pick the keys;
2. grid (rows,): the row's logsumexp from the chunk sums, and its `top` largest keys among the
   chunks' candidates, in the same order; given the sampled tokens, also their
   log-probabilities (once sampling is done, when it sampled from these logits unchanged).

A token's log-probability is then its logit minus the row's logsumexp, as
torch.log_softmax(dtype=float32) computes it (the sums may round differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv, next_power_of_2
from kernels.sampling import row_chunk_mass, row_chunk_max

NO_KEY = tl.constexpr(-(2**63))  # below every key: a dropped or padding candidate
GROUP = 32  # logits per group of a chunk (see _chunk_top_kernel)
CHUNK = 4096  # vocabulary entries per chunk by default (the launch shapes measured best)


@triton.jit
def _order_key(x, ids):
    """int64 keys whose signed order is (logit `x` ascending, then id descending): the float's
    bits, turned so that their signed integer order is the float order, above 2**31 - 1 - id."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)


@triton.jit
def _key_logit(key):
    bits = (key >> 32).to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key):
    return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _chunk_top_kernel(logits_ptr, stride_row, max_ptr, sum_ptr, cand_ptr, vocab, num_chunks, top,
                      CHUNK: tl.constexpr, GROUP: tl.constexpr, TOP_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * CHUNK
    row_ptr = logits_ptr + row * stride_row
    # The chunk as [CHUNK // GROUP, GROUP]: each group's largest logit in one pass.
    groups = tl.arange(0, CHUNK // GROUP)
    members = tl.arange(0, GROUP)
    cols = start + groups[:, None] * GROUP + members[None, :]
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    group_max = tl.max(x, 1)
    chunk_max = tl.max(group_max, 0)
    mass = tl.sum(tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - chunk_max)), 1), 0)
    out = row * num_chunks + tl.program_id(1)
    tl.store(max_ptr + out, chunk_max)
    tl.store(sum_ptr + out, mass)
    if TOP_P2 > 0:
        # The `top` largest keys lie in the first `top` groups in the order "larger maximum,
        # then lower group" (each group before the one holding a top key holds a larger key),
        # so rounds over the groups' keys pick those groups, and the rounds over logits' keys
        # run on them alone.
        group_key = _order_key(group_max, groups)
        slots = tl.arange(0, TOP_P2)
        chosen = tl.full([TOP_P2], -1, tl.int32)
        for j in range(top):
            best = tl.max(group_key, 0)
            chosen = tl.where((slots == j) & (best != NO_KEY), _key_id(best), chosen)
            group_key = tl.where(group_key == best, NO_KEY, group_key)
        cols = start + chosen[:, None] * GROUP + members[None, :]
        taken = (chosen >= 0)[:, None]
        x = tl.load(row_ptr + cols, mask=taken & (cols < vocab),
                    other=float("-inf")).to(tl.float32)
        key = tl.where(taken, _order_key(x, cols), NO_KEY)
        for j in range(top):
            best = tl.max(tl.max(key, 1), 0)
            tl.store(cand_ptr + out * top + j, best)
            key = tl.where(key == best, NO_KEY, key)


@triton.jit
def _row_top_kernel(max_ptr, sum_ptr, cand_ptr, lse_ptr, out_val_ptr, out_id_ptr, out_stride,
                    num_chunks, top, logits_ptr, stride_row, token_ptr, token_out_ptr,
                    token_out_stride, CHUNKS_P2: tl.constexpr, CANDS_P2: tl.constexpr,
                    SAMPLED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks, chunk_max, row_max = row_chunk_max(max_ptr, row, num_chunks, CHUNKS_P2)
    mass = row_chunk_mass(sum_ptr, row, num_chunks, chunks, chunk_max, row_max)
    lse = row_max + tl.log(tl.sum(mass, 0))
    tl.store(lse_ptr + row, lse)
    if SAMPLED:
        token = tl.load(token_ptr + row).to(tl.int64)
        logit = tl.load(logits_ptr + row * stride_row + token).to(tl.float32)
        tl.store(token_out_ptr + row * token_out_stride, logit - lse)
    # The chunks' candidates: the row's [chunks, top] keys, padded to CANDS_P2.
    slots = tl.arange(0, CANDS_P2)
    cand = tl.load(cand_ptr + row * num_chunks * top + slots, mask=slots < num_chunks * top,
                   other=NO_KEY)
    for j in range(top):
        best = tl.max(cand, 0)
        tl.store(out_val_ptr + row * out_stride + j, _key_logit(best) - lse)
        tl.store(out_id_ptr + row * out_stride + j, _key_id(best))
        cand = tl.where(cand == best, NO_KEY, cand)


_launch_chunk_top = DirectLaunch(_chunk_top_kernel)
_launch_row_top = DirectLaunch(_row_top_kernel)


@dataclass
class LogprobScratch:
    """The kernels' working memory for `rows` rows of `vocab` logits and `top` tokens: one
    allocation a batch shape instead of four a call (a caller keeps it between steps; calls on
    one stream may share it)."""

    lse: torch.Tensor  # float32 [rows]
    chunk_max: torch.Tensor  # float32 [rows, chunks]
    chunk_sum: torch.Tensor  # float32 [rows, chunks]
    cand: torch.Tensor  # int64 [rows, chunks, max(top, 1)]
    chunk: int = CHUNK  # vocabulary entries per chunk (a power of two)

    @classmethod
    def allocate(cls, rows: int, vocab: int, top: int, device: torch.device,
                 chunk: int = CHUNK) -> LogprobScratch:
        num_chunks = cdiv(vocab, chunk)
        return cls(torch.empty(rows, dtype=torch.float32, device=device),
                   torch.empty(rows, num_chunks, dtype=torch.float32, device=device),
                   torch.empty(rows, num_chunks, dtype=torch.float32, device=device),
                   torch.empty(rows, num_chunks, max(top, 1), dtype=torch.int64, device=device),
                   chunk)


def logprob_stats(logits: torch.Tensor, top: int, chunk: int | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  sampled: tuple[torch.Tensor, torch.Tensor] | None = None,
                  scratch: LogprobScratch | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of `logits` [rows, vocab] (any float dtype): each row's logsumexp (float32 [rows]) and
    its `top` most likely tokens' log-probabilities (float32 [rows, top], descending; equal
    ones lowest id first) and ids (int32 [rows, top]: what the step's reply carries). `out`:
    where to write the last two (views with one row stride and unit column stride, e.g.
    columns of one table). `sampled`: (token ids [rows], a float32 [rows] view) to write each
    row's token's log-probability into. `scratch`: working memory of this shape and `chunk`
    (`LogprobScratch.allocate`; `chunk` defaults to its, else to `CHUNK`), whose `lse` is
    returned. The two phases, `logprob_chunks` then `logprob_rows`, may also be launched
    apart (on two streams, the second waiting)."""
    logits = _unit_stride(logits)
    if scratch is None:
        scratch = LogprobScratch.allocate(logits.shape[0], logits.shape[1], top, logits.device,
                                          chunk or CHUNK)
    assert chunk is None or chunk == scratch.chunk, "scratch of another chunk size"
    logprob_chunks(logits, top, scratch)
    return logprob_rows(logits, top, scratch, out, sampled)


def _unit_stride(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 else logits.contiguous()


def logprob_chunks(logits: torch.Tensor, top: int, scratch: LogprobScratch) -> None:
    """`logprob_stats`' first phase: each chunk's largest logit, its sum of exponentials and
    its `top` candidates, into `scratch` (unit stride along the vocabulary)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    num_chunks, chunk = scratch.chunk_max.shape[1], scratch.chunk
    assert scratch.cand.shape == (rows, num_chunks, max(top, 1)) and \
        num_chunks == cdiv(vocab, chunk), "scratch of another shape"
    if rows == 0:
        return
    _launch_chunk_top((rows, num_chunks),
        logits, logits.stride(0), scratch.chunk_max, scratch.chunk_sum, scratch.cand, vocab,
        num_chunks, top, CHUNK=chunk, GROUP=min(GROUP, chunk),
        TOP_P2=next_power_of_2(top) if top else 0, num_warps=4)


def logprob_rows(logits: torch.Tensor, top: int, scratch: LogprobScratch,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 sampled: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprob_stats`' second phase, from the chunks `logprob_chunks` wrote into `scratch`
    (the same `logits`, which it reads again only for the sampled tokens)."""
    rows = logits.shape[0]
    device = logits.device
    if out is None:
        top_lp = torch.empty(rows, top, dtype=torch.float32, device=device)
        top_ids = torch.empty(rows, top, dtype=torch.int32, device=device)
    else:
        top_lp, top_ids = out
        assert top_lp.dtype == torch.float32 and top_ids.dtype == torch.int32
        assert top_lp.shape == top_ids.shape == (rows, top)
        assert top_lp.stride() == top_ids.stride() and (top <= 1 or top_lp.stride(1) == 1)
    if rows == 0:
        return scratch.lse, top_lp, top_ids
    num_chunks = scratch.chunk_max.shape[1]
    tokens, token_out = sampled if sampled is not None else (scratch.lse, scratch.lse)
    _launch_row_top((rows,),
        scratch.chunk_max, scratch.chunk_sum, scratch.cand, scratch.lse, top_lp, top_ids,
        top_lp.stride(0), num_chunks, top, logits, logits.stride(0), tokens, token_out,
        token_out.stride(0), CHUNKS_P2=max(2, next_power_of_2(num_chunks)),
        CANDS_P2=max(2, next_power_of_2(num_chunks * max(top, 1))),
        SAMPLED=sampled is not None, num_warps=4)
    return scratch.lse, top_lp, top_ids
