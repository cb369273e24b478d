"""The logits pipeline of an engine: every control between a step's forward and its sampled
tokens, in `SamplingParams`' order, each defined once with its torch reference and its Triton
kernel side by side (`sampler.uses_kernels` picks one for a step's logits): log-probabilities
read from the raw logits; the edits (`EDITS`: penalties, logit bias, bad words, min_p); the
min_tokens mask (`start`); the grammars' masks (the engine's); then sampling (`sample`):
temperature, min_p's floor, top-k and top-p.

Each table row has its request's settings (`core.RowSampling`, decided on admission) and the
state the controls need on the device, next to the token pool: generated-token counts and a
prompt-token mask (penalties), a padded table of bias entries and one of bad-word sequences.
The device state is allocated on first use and updated from the sampled tokens on the device,
so overlap scheduling needs nothing back from the scheduler. A step in which no row uses a
control runs none of its code: each control checks one host flag per row first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypeVar

import numpy as np
import torch

from minisgl_backend.core import RowSampling
from minisgl_backend.device_copy import host_to_device
from minisgl_backend.engine.protocol import LogprobColumns, StepMessage, ranges
from minisgl_backend.engine.sampler import SamplingTensors, greedy, sample, uses_kernels

if TYPE_CHECKING:  # Triton's kernels are imported where a GPU runs them
    from kernels.logit_edits import EditTables
    from kernels.logprobs import LogprobScratch
    from kernels.sampling import MinPFloor


T = TypeVar("T")


@dataclass
class LogprobReport:
    """One step's log-probabilities on the device, for the rows that asked (batch order)."""

    batch_rows: np.ndarray  # [m] on cpu: batch indices of the rows
    table: torch.Tensor  # [m, LogprobColumns.width] float32, every column filled


@dataclass
class RawLogprobs:
    """A step's log-probabilities as far as the raw logits give them (before the controls
    edit the logits and the tokens are sampled), for the rows that asked (batch order)."""

    batch_rows: np.ndarray  # [m] on cpu: batch indices of the rows
    # [m, vocab]: float32 log-probabilities (torch path), or the raw logits rows with `lse`
    # their logsumexp (Triton kernels: the full log-softmax is never written).
    values: torch.Tensor
    lse: torch.Tensor | None  # [m] float32
    table: torch.Tensor  # [m, LogprobColumns.width] float32: the top columns filled


@dataclass
class _LogprobBuffers:
    """A log-probability table of one batch shape with its views, and the kernels' working
    memory (`kernels.logprobs.LogprobScratch`), made once: each view costs the host a call."""

    table: torch.Tensor  # [rows, LogprobColumns(top).width] float32
    top: tuple[torch.Tensor, torch.Tensor]  # its top log-probabilities' and ids' columns
    token: torch.Tensor  # its sampled token's column
    scratch: LogprobScratch

    @classmethod
    def allocate(cls, rows: int, top: int, vocab: int, device: torch.device) -> _LogprobBuffers:
        from kernels.logprobs import LogprobScratch

        cols = LogprobColumns(top)
        table = torch.empty(rows, cols.width, dtype=torch.float32, device=device)
        return cls(table, (table[:, cols.top_logprobs], table[:, cols.top_ids].view(torch.int32)),
                   table[:, cols.token], LogprobScratch.allocate(rows, vocab, top, device))


@dataclass
class PendingLogprobs:
    """`LogitControls.begin_logprobs`' launch: the reporting rows (batch indices), their raw
    logits, the most top tokens one asks for, its buffers, and its stream (None: current)."""

    batch_rows: np.ndarray
    logits: torch.Tensor
    top: int
    buffers: _LogprobBuffers
    stream: torch.cuda.Stream | None


@dataclass
class _EditRows:
    """What the edit kernels take of one batch's rows (`kernels.logit_edits.apply_edits`),
    uploaded once per batch until the next admission."""

    program_rows: torch.Tensor  # [2, m] int64: batch index and flags of each program row
    factors: torch.Tensor  # [m, FACTORS] float32
    flags: int  # the union of the rows' flags
    tables: EditTables
    min_p: MinPFloor | None  # min_p's floor, if a row uses min_p


class BatchRows(NamedTuple):
    """A step's batch as the controls read it: each entry's table row (on the host and the
    device), and the position of the token it samples, the row's length once the token is
    appended (on the device and the host)."""

    rows: np.ndarray
    rows_t: torch.Tensor
    next_positions: torch.Tensor
    seq_lens: np.ndarray


@dataclass
class StepLogits:
    """A step's logits on their way through the pipeline (`LogitControls.start` -> `sample` ->
    `finish`)."""

    logits: torch.Tensor  # [entries, vocab], as sampling reads them
    # The forward's logits, unedited: `logits` itself, or the raw values the edited copy was
    # made from (the log-probabilities are taken of them after sampling).
    raw: torch.Tensor
    batch: BatchRows
    edited: bool = False  # some row's logits are edited (`apply`)
    min_p: MinPFloor | None = None  # min_p's floor, left to sampling by the edit kernels
    raw_logprobs: RawLogprobs | None = None  # `raw_logprobs`
    # Log-probabilities taken after sampling, from `raw` (on a GPU begun before it).
    sampled_logprobs: bool = False
    pending_logprobs: PendingLogprobs | None = None  # `begin_logprobs`


class LogitControls:
    """The logits pipeline of one engine, and every table row's settings (`params`) and state.
    `start` reads and edits a step's logits and applies min_tokens' mask, `sample` samples
    them, `finish` counts the sampled tokens and reports their log-probabilities."""

    def __init__(self, num_rows: int, vocab_size: int, token_pool: torch.Tensor) -> None:
        self.params = RowSampling.table(num_rows)
        self.vocab_size = vocab_size
        self.token_pool = token_pool  # [rows, max_seq_len + 1] int32, the engine's
        self.device = token_pool.device
        self.prompt_len = np.zeros(num_rows, dtype=np.int64)
        # Host flags beside `params`' (a step checks these before any device work): rows with
        # bias entries, with bad-word sequences, and with any edit (`EDITS`).
        self.biased = np.zeros(num_rows, dtype=bool)
        self.banned = np.zeros(num_rows, dtype=bool)
        self.edited = np.zeros(num_rows, dtype=bool)
        # min_tokens: a row's stop ids are masked while it samples positions below min_len.
        self.min_len = np.zeros(num_rows, dtype=np.int64)
        self.stop_ids: dict[int, torch.Tensor] = {}
        self.num_rows = num_rows
        # Device state, allocated on first use.
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32: tokens generated
        self._flat_counts: torch.Tensor | None = None  # its view as [rows * vocab]
        self.in_prompt: torch.Tensor | None = None  # [rows, vocab] bool: tokens of the prompt
        self.bias_ids: torch.Tensor | None = None  # [rows, width] int64 (padding: 0 with 0.0)
        self.bias_values: torch.Tensor | None = None  # [rows, width] float32
        # [rows, sequences, length] int64: bad-word sequences right-aligned (the banned token
        # last), -1 where a shorter sequence has no token; a row's unused sequences are all -1.
        self.ban_tokens: torch.Tensor | None = None
        # Values made once per (what, a batch's rows) until the next admission (device copies
        # of row indices, factors, sampling parameters): an unchanged batch makes none again.
        self._uploads: dict[tuple[str, bytes], Any] = {}
        self._lp_buffers: dict[tuple[int, int], _LogprobBuffers] = {}  # (rows, top)
        self._stream: torch.cuda.Stream | None = None  # `begin_logprobs`' side stream

    def _per_batch(self, what: str, rows: np.ndarray, make: Callable[[], T]) -> T:
        """`make()`, made once per (what, rows) until the next admission."""
        key = (what, rows.tobytes())
        found = self._uploads.get(key)
        if found is None:
            if len(self._uploads) >= 256:  # many batch shapes in a row: start over
                self._uploads.clear()
            found = self._uploads[key] = make()
        return found

    def _upload(self, what: str, key: np.ndarray, make: Callable[[], np.ndarray],
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """`make()` on the device, uploaded once per (what, key) until the next admission."""
        return self._per_batch(what, key, lambda: host_to_device(make(), self.device, dtype))

    # ----- admission ---------------------------------------------------------------------

    def admit(self, msg: StepMessage) -> None:
        """Rows of `msg.admit_rows` start new requests: their settings, flags and device
        state."""
        rows = np.asarray(msg.admit_rows, dtype=np.int64)
        assert msg.admit is not None, "admitted rows without their settings"
        self.params.put(rows, msg.admit)
        self._uploads.clear()
        was_biased, was_banned = self.biased[rows].copy(), self.banned[rows].copy()
        self.biased[rows] = False
        self.banned[rows] = False
        penalized = rows[self.params.uses_penalties[rows]]
        if len(penalized):
            self._reset_penalty_state(penalized)
        if len(msg.prompt_rows):
            self._take_prompts(msg)
        if was_biased.any():
            self._clear(self.bias_ids, rows[was_biased], 0)
            self._clear(self.bias_values, rows[was_biased], 0)
        if len(msg.bias_rows):
            self._take_biases(msg)
        if was_banned.any():
            self._clear(self.ban_tokens, rows[was_banned], -1)
        if len(msg.ban_rows):
            self._take_bans(msg)
        self.edited[rows] = np.logical_or.reduce([edit.uses(self)[rows] for edit in EDITS])
        self.min_len[rows] = 0
        if len(msg.min_rows):
            self._take_min_lens(msg)

    def _clear(self, table: torch.Tensor | None, rows: np.ndarray, value: int) -> None:
        if table is not None:
            table[host_to_device(rows, self.device)] = value

    def _reset_penalty_state(self, rows: np.ndarray) -> None:
        if self.counts is None:
            shape = (self.num_rows, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._flat_counts = self.counts.view(-1)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        rows_t = host_to_device(rows, self.device)
        self.counts[rows_t] = 0
        self.in_prompt[rows_t] = False

    def count_from(self, rows: np.ndarray, lens: np.ndarray) -> None:
        """Samples of rows `rows` count as output tokens (penalties) from `lens` tokens on:
        a LongRoPE restart computes a row's output tokens again as prompt chunks."""
        self.prompt_len[rows] = lens

    def _take_prompts(self, msg: StepMessage) -> None:
        """Whole prompts of rows that need them: into the token pool (bad-word prefixes may
        reach into a cached prefix, which no step sends) and the prompt mask (penalties)."""
        rows = np.asarray(msg.prompt_rows, dtype=np.int64)
        counts = np.asarray(msg.prompt_counts, dtype=np.int64)
        self.prompt_len[rows] = counts
        row_of = np.repeat(rows, counts)
        positions = ranges(0, counts)
        tokens = host_to_device(np.asarray(msg.prompt_tokens, dtype=np.int64), self.device)
        row_t = host_to_device(row_of, self.device)
        self.token_pool[row_t, host_to_device(positions, self.device)] = tokens.to(torch.int32)
        penalized = self.params.uses_penalties[row_of]
        if penalized.any():
            keep = host_to_device(np.nonzero(penalized)[0], self.device)
            self.in_prompt[row_t[keep], tokens[keep]] = True

    def _take_min_lens(self, msg: StepMessage) -> None:
        counts = np.asarray(msg.min_stop_counts, dtype=np.int64)
        stop_ids = np.split(np.asarray(msg.min_stop_ids, dtype=np.int64), np.cumsum(counts)[:-1])
        for row, min_len, ids in zip(np.asarray(msg.min_rows).tolist(),
                                     np.asarray(msg.min_lens).tolist(), stop_ids):
            self.min_len[row] = min_len
            self.stop_ids[row] = host_to_device(ids, self.device)

    def _take_biases(self, msg: StepMessage) -> None:
        rows = np.asarray(msg.bias_rows, dtype=np.int64)
        counts = np.asarray(msg.bias_counts, dtype=np.int64)
        width = int(counts.max())
        if self.bias_ids is None or self.bias_ids.shape[1] < width:
            self.bias_ids = _widen(self.bias_ids, (self.num_rows, _pow2(width)), 0, self.device)
            self.bias_values = _widen(self.bias_values, (self.num_rows, _pow2(width)), 0,
                                      self.device, torch.float32)
        cols = ranges(0, counts)
        row_t, col_t, ids_t = (host_to_device(a, self.device) for a in (
            np.repeat(rows, counts), cols, np.asarray(msg.bias_ids, dtype=np.int64)))
        self.bias_ids[row_t, col_t] = ids_t
        self.bias_values[row_t, col_t] = host_to_device(msg.bias_values, self.device,
                                                        torch.float32)
        self.biased[rows] = True

    def _take_bans(self, msg: StepMessage) -> None:
        rows = np.asarray(msg.ban_rows, dtype=np.int64)
        lens = np.asarray(msg.ban_lens, dtype=np.int64)
        # Sequence slot of each sequence within its row (rows arrive grouped).
        first = np.r_[True, rows[1:] != rows[:-1]]
        group_start = np.maximum.accumulate(np.where(first, np.arange(len(rows)), 0))
        slot = np.arange(len(rows)) - group_start
        shape = (self.num_rows, _pow2(int(slot.max()) + 1), _pow2(int(lens.max())))
        old = self.ban_tokens
        if old is None or any(a < b for a, b in zip(old.shape, shape)):
            shape = tuple(max(a, b) for a, b in zip(shape, old.shape if old is not None
                                                    else shape))
            self.ban_tokens = torch.full(shape, -1, dtype=torch.int64, device=self.device)
            if old is not None:  # running rows' sequences stay right-aligned
                self.ban_tokens[:, : old.shape[1], shape[2] - old.shape[2]:] = old
        length = self.ban_tokens.shape[2]
        seq_of = np.repeat(np.arange(len(rows)), lens)
        # Right-aligned: a sequence's last token goes in the last column.
        col = ranges(length - lens, lens)
        idx = [host_to_device(a, self.device) for a in (rows[seq_of], slot[seq_of], col)]
        self.ban_tokens[idx[0], idx[1], idx[2]] = host_to_device(
            np.asarray(msg.ban_tokens, dtype=np.int64), self.device)
        self.banned[rows] = True

    # ----- a step ------------------------------------------------------------------------

    def start(self, logits: torch.Tensor, batch: BatchRows, guided: bool,
              reports: bool) -> StepLogits:
        """The pipeline up to the grammars' masks: the raw log-probabilities (or, on a GPU,
        their first kernel), the edits, then min_tokens' mask. `guided`: grammar masks follow
        (before `sample`); `reports`: this engine answers the step (rank 0)."""
        rows, seq_lens = batch.rows, batch.seq_lens
        step = StepLogits(logits, logits, batch, edited=bool(self.edited[rows].any()))
        reported = reports and bool(self.params.reports[rows].any())
        early_stops = np.nonzero(self.min_len[rows] > seq_lens)[0]
        if reported:
            # The log-probabilities wait until after sampling (`finish`, where the kernels also
            # fill the sampled tokens' column), read from the raw logits: the edits then write a
            # copy. Masks alone (grammars, min_tokens) edit in place, after the raw statistics.
            step.sampled_logprobs = step.edited or not (guided or len(early_stops))
            if not step.sampled_logprobs:
                step.raw_logprobs = self.raw_logprobs(logits, rows)
            else:  # on a GPU their first kernel runs beside the edits and sampling
                step.pending_logprobs = self.begin_logprobs(logits, rows)
        if step.edited:
            step.logits, step.min_p = self.apply(logits, *batch, keep_raw=reported,
                                                 leave_floor=True)
        for i in early_stops.tolist():  # below their min_tokens: no stop id (rare: a loop)
            step.logits[i, self.stop_ids[int(rows[i])]] = float("-inf")
        return step

    def sample(self, step: StepLogits) -> torch.Tensor:
        """The step's tokens (int64): temperature, min_p's floor, top-k and top-p
        (`sampler.sample`), or the argmax where every row is greedy."""
        batch = step.batch
        if self.params.greedy[batch.rows].all():
            return greedy(step.logits, step.min_p)
        return sample(step.logits, self._sampling_tensors(
            step.logits, batch.rows, batch.next_positions, batch.seq_lens, step.min_p))

    def _sampling_tensors(self, logits: torch.Tensor, rows: np.ndarray, positions: torch.Tensor,
                          host_positions: np.ndarray, min_p: MinPFloor | None = None
                          ) -> SamplingTensors:
        """The rows' sampling parameters, uploaded once per batch until the next admission,
        at this step's positions."""
        kept = self._per_batch("sampling", rows,
                               lambda: SamplingTensors.of(self.params, rows, self.device))
        return kept.at(logits, positions, host_positions, min_p)

    def finish(self, step: StepLogits, tokens: torch.Tensor) -> LogprobReport | None:
        """After sampling `tokens` (int64, as sampled): the penalties' counts, and the
        log-probabilities of the rows that report them (None if no row does)."""
        rows = step.batch.rows
        if step.edited:
            self.record(rows, step.batch.rows_t, tokens, step.batch.seq_lens)
        if step.raw_logprobs is not None:
            return self.report(step.raw_logprobs, rows, tokens)
        if step.sampled_logprobs:
            return self.sampled_logprobs(step.raw, rows, tokens, step.pending_logprobs)
        return None

    def raw_logprobs(self, logits: torch.Tensor, rows: np.ndarray) -> RawLogprobs | None:
        """What the rows reporting log-probabilities need of the raw logits, taken before masks
        (grammars, min_tokens) set some of them to -inf in place; None if no row asks.
        `report` completes it after sampling: a mask leaves the sampled tokens' logits raw."""
        reporting = self._reporting(logits, rows)
        if reporting is None:
            return None
        wanted, sel, top = reporting
        if not uses_kernels(sel):
            cols = LogprobColumns(top)
            table = torch.empty(len(wanted), cols.width, dtype=torch.float32, device=sel.device)
            top_lp, top_ids = table[:, cols.top_logprobs], table[:, cols.top_ids].view(torch.int32)
            logprobs = torch.log_softmax(sel, dim=-1, dtype=torch.float32)
            top_lp[:], top_ids[:] = logprobs.topk(top, dim=-1)
            return RawLogprobs(wanted, logprobs, None, table)
        from kernels.logprobs import logprob_stats

        buffers = self._logprob_buffers(len(wanted), top)
        lse, _, _ = logprob_stats(sel, top, out=buffers.top, scratch=buffers.scratch)
        return RawLogprobs(wanted, sel, lse, buffers.table)

    def report(self, raw: RawLogprobs, rows: np.ndarray, tokens: torch.Tensor) -> LogprobReport:
        """The sampled tokens' log-probabilities next to the top alternatives of `raw`."""
        wanted = raw.batch_rows
        picked = raw.values.gather(
            1, self._wanted(tokens, rows, wanted).long().unsqueeze(1)).squeeze(1)
        column = raw.table[:, LogprobColumns.token]
        if raw.lse is not None:
            torch.sub(picked, raw.lse, out=column)
        else:
            column.copy_(picked)
        return LogprobReport(wanted, raw.table)

    def begin_logprobs(self, logits: torch.Tensor, rows: np.ndarray) -> PendingLogprobs | None:
        """On a GPU, the first half of `sampled_logprobs`, launched now on a side stream beside
        the edits and sampling (which leave `logits` raw: `apply` with `keep_raw`). None if no
        row asks, or off the kernels' path (`sampled_logprobs` then does it all)."""
        if not uses_kernels(logits):
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._chunk_statistics(logits, rows, self._stream)

    def sampled_logprobs(self, logits: torch.Tensor, rows: np.ndarray,
                         tokens: torch.Tensor, pending: PendingLogprobs | None = None
                         ) -> LogprobReport | None:
        """`raw_logprobs` and `report` in one go, after sampling, from the raw `logits` (on a
        GPU the kernels write the sampled tokens' column too). `pending`: what `begin_logprobs`
        launched for these logits. None if no row asks."""
        if not uses_kernels(logits):
            raw = self.raw_logprobs(logits, rows)
            return self.report(raw, rows, tokens) if raw is not None else None
        from kernels.logprobs import logprob_rows

        if pending is None:
            pending = self._chunk_statistics(logits, rows)
            if pending is None:
                return None
        elif pending.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(pending.stream)
        buffers = pending.buffers
        logprob_rows(pending.logits, pending.top, buffers.scratch, out=buffers.top,
                     sampled=(self._wanted(tokens, rows, pending.batch_rows), buffers.token))
        return LogprobReport(pending.batch_rows, buffers.table)

    def _chunk_statistics(self, logits: torch.Tensor, rows: np.ndarray,
                          stream: torch.cuda.Stream | None = None) -> PendingLogprobs | None:
        """The log-probability kernels' first phase over the reporting rows' raw `logits`, on
        `stream` (after the current stream's work so far) or else the current stream."""
        from kernels.logprobs import logprob_chunks

        reporting = self._reporting(logits, rows)
        if reporting is None:
            return None
        wanted, sel, top = reporting
        buffers = self._logprob_buffers(len(wanted), top)
        if stream is None:
            logprob_chunks(sel, top, buffers.scratch)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the logits are written
            with torch.cuda.stream(stream):
                logprob_chunks(sel, top, buffers.scratch)
            # `sel` may be a gather: the allocator must not hand its memory to the main stream's
            # next work before the side stream has read it (the buffers live in `_lp_buffers`).
            sel.record_stream(stream)
        return PendingLogprobs(wanted, sel, top, buffers, stream)

    def _reporting(self, logits: torch.Tensor, rows: np.ndarray
                   ) -> tuple[np.ndarray, torch.Tensor, int] | None:
        """The batch indices of the rows that report log-probabilities, their logits and the
        most top tokens one asks for; None if no row asks."""
        logprobs = self.params.logprobs[rows]
        wanted = np.nonzero(logprobs >= 0)[0]
        if len(wanted) == 0:
            return None
        return wanted, self._wanted(logits, rows, wanted), int(logprobs[wanted].max())

    def _wanted(self, values: torch.Tensor, rows: np.ndarray, wanted: np.ndarray) -> torch.Tensor:
        """The entries of `values` (one per batch row) of the rows that report."""
        return values if len(wanted) == len(rows) else values[
            self._upload("logprob rows", rows, lambda: wanted)]

    def _logprob_buffers(self, rows: int, top: int) -> _LogprobBuffers:
        """The kernels' table and working memory for `rows` rows and `top` tokens, kept between
        steps (a step's table is copied to the host before the next step writes it)."""
        buffers = self._lp_buffers.get((rows, top))
        if buffers is None:
            if len(self._lp_buffers) >= 64:  # many batch shapes in a row: start over
                self._lp_buffers.clear()
            buffers = self._lp_buffers[(rows, top)] = _LogprobBuffers.allocate(
                rows, top, self.vocab_size, self.device)
        return buffers

    def apply(self, logits: torch.Tensor, rows: np.ndarray, rows_t: torch.Tensor,
              next_positions: torch.Tensor, seq_lens: np.ndarray, keep_raw: bool = False,
              leave_floor: bool = False) -> tuple[torch.Tensor, MinPFloor | None]:
        """The edits (`EDITS`) on `logits` [bs, vocab], in order: the logits to sample from
        (edited in place, or with `keep_raw` an edited copy) and, with `leave_floor`, min_p's
        floor where the kernels left it to the sampler, else None. The other arguments are
        `BatchRows`' fields."""
        if uses_kernels(logits):  # one kernel; min_p's floor in a second or in sampling's
            from kernels.logit_edits import apply_edits

            edits = self._per_batch("edit rows" if keep_raw else "edited rows", rows,
                                    lambda: self._edit_rows(rows, keep_raw))
            out = torch.empty_like(logits) if keep_raw else logits
            apply_edits(logits, out, edits.program_rows, rows_t, next_positions, edits.factors,
                        edits.tables, edits.flags, min_p=edits.min_p, floor=not leave_floor)
            return out, edits.min_p if leave_floor else None
        if keep_raw:
            logits = logits.clone()
        batch = BatchRows(rows, rows_t, next_positions, seq_lens)
        for edit in EDITS:
            which = edit.uses(self)[rows]
            if which.any():
                edit.torch_ref(self, logits, batch, which)
        return logits, None

    def _edit_rows(self, rows: np.ndarray, every_row: bool) -> _EditRows:
        """The edit kernels' rows of a batch: its edited rows, or `every_row` (a copy is
        written: rows without edits are copied)."""
        from kernels import logit_edits as k

        which = np.arange(len(rows)) if every_row else np.nonzero(self.edited[rows])[0]
        sel = rows[which]
        flags = sum(flag * edit.uses(self)[sel] for flag, edit in zip(k.EDIT_FLAGS, EDITS))
        p = self.params
        factors = np.zeros((len(sel), k.FACTORS), dtype=np.float32)
        penalized = p.uses_penalties[sel]
        factors[:, k.REPETITION] = np.where(penalized, p.repetition_penalty[sel], 1.0)
        factors[:, k.PRESENCE] = np.where(penalized, p.presence_penalty[sel], 0.0)
        factors[:, k.FREQUENCY] = np.where(penalized, p.frequency_penalty[sel], 0.0)
        uses_min_p = p.uses_min_p[sel]  # per program row
        factors[uses_min_p, k.MIN_P_OFFSET] = self._min_p_offsets(sel[uses_min_p])
        union = int(np.bitwise_or.reduce(flags))
        in_prompt = self.in_prompt.view(torch.uint8) if self.in_prompt is not None else None
        factors_t = host_to_device(factors, self.device)
        floor = None
        if union & k.MIN_P:
            from kernels.sampling import MinPFloor

            program_of = np.full(len(rows), -1, dtype=np.int64)  # per batch row
            program_of[which[uses_min_p]] = np.nonzero(uses_min_p)[0]
            floor = MinPFloor(host_to_device(program_of, self.device),
                              k.min_p_scratch(len(which), self.vocab_size, self.device),
                              factors_t[:, k.MIN_P_OFFSET])
        return _EditRows(
            program_rows=host_to_device(np.stack([which, flags]).astype(np.int64), self.device),
            factors=factors_t, flags=union,
            tables=k.EditTables(self.counts, in_prompt, (self.bias_ids, self.bias_values)
                                if self.bias_ids is not None else None, self.ban_tokens,
                                self.token_pool),
            min_p=floor)

    # The edits' torch references, on the entries `which` (a mask) of a batch that use them.

    def _penalize(self, logits: torch.Tensor, batch: BatchRows, penalized: np.ndarray) -> None:
        """HF's repetition penalty on the tokens of the prompt or the output (positive logits
        divided by it, negative ones multiplied), then OpenAI's presence and frequency
        penalties on the output's."""
        assert self.counts is not None and self.in_prompt is not None
        which = np.nonzero(penalized)[0]
        p, rows = self.params, batch.rows
        sel_rows = rows[which]
        rep, presence, frequency = self._upload("penalties", rows, lambda: np.stack(
            [p.repetition_penalty[sel_rows], p.presence_penalty[sel_rows],
             p.frequency_penalty[sel_rows]]), torch.float32).unsqueeze(2)
        which_t, row_t = self._upload("penalized rows", rows,
                                      lambda: np.stack([which, sel_rows]), torch.int64)
        lens = batch.seq_lens[which]
        if 2 * int(lens.max()) < self.vocab_size:
            # Only the tokens a row has seen change: its token pool row holds them all (the
            # prompt came on admission). Repeated ids write the same value, so scatter is exact.
            last = batch.next_positions[which_t].unsqueeze(1) - 1  # each row's last position
            positions = torch.arange(int(lens.max()), device=logits.device).unsqueeze(0)
            ids = self.token_pool[row_t.unsqueeze(1), positions.minimum(last)].long()
            counts = self.counts[row_t.unsqueeze(1), ids]
            x = logits[which_t.unsqueeze(1), ids].float()
            x = torch.where(x > 0, x / rep, x * rep) - frequency * counts - presence * (counts > 0)
            logits[which_t.unsqueeze(1), ids] = x.to(logits.dtype)
            return
        counts = self.counts[row_t]
        seen = (counts > 0) | self.in_prompt[row_t]
        sub = logits[which_t].float()
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - frequency * counts - presence * (counts > 0)
        logits[which_t] = sub.to(logits.dtype)

    def _bias(self, logits: torch.Tensor, batch: BatchRows, _: np.ndarray) -> None:
        """Each bias entry added to its token's logit (a row's padding entries add 0.0)."""
        assert self.bias_ids is not None and self.bias_values is not None
        logits.scatter_add_(1, self.bias_ids[batch.rows_t],
                            self.bias_values[batch.rows_t].to(logits.dtype))

    def _ban(self, logits: torch.Tensor, batch: BatchRows, _: np.ndarray) -> None:
        """Mask every sequence's last token where the tokens before it end the row so far."""
        assert self.ban_tokens is not None
        rows_t, next_positions = batch.rows_t, batch.next_positions
        table = self.ban_tokens[rows_t]  # [bs, sequences, length]
        length = table.shape[2]
        last = table[:, :, -1]
        hit = last >= 0
        if length > 1:
            pos = next_positions.unsqueeze(1) - (length - 1) + torch.arange(
                length - 1, device=logits.device)
            context = self.token_pool[rows_t.unsqueeze(1), pos.clamp(min=0)].long()
            context = torch.where(pos >= 0, context, -2)  # before the start: matches nothing
            prefix = table[:, :, :-1]
            hit &= ((prefix == context.unsqueeze(1)) | (prefix < 0)).all(dim=-1)
        penalty = torch.where(hit, float("-inf"), 0.0).to(logits.dtype)
        logits.scatter_add_(1, last.clamp(min=0), penalty)

    def _min_p(self, logits: torch.Tensor, batch: BatchRows, which_mask: np.ndarray) -> None:
        """Drop tokens whose probability at the row's temperature is below min_p times the
        top one's: logit < max + temperature * log(min_p)."""
        which, rows = np.nonzero(which_mask)[0], batch.rows
        offset_t = self._upload("min_p", rows, lambda: self._min_p_offsets(rows[which]),
                                torch.float32).unsqueeze(1)
        if len(which) == len(rows):
            floor = logits.amax(dim=-1, keepdim=True).float() + offset_t
            logits.masked_fill_(logits < floor, float("-inf"))
            return
        idx = self._upload("min_p rows", rows, lambda: which)
        sub = logits[idx]
        floor = sub.amax(dim=-1, keepdim=True).float() + offset_t
        logits[idx] = sub.masked_fill(sub < floor, float("-inf"))

    def _min_p_offsets(self, rows: np.ndarray) -> np.ndarray:
        """How far below a row's largest logit min_p drops tokens: a token's probability at
        the row's temperature is below min_p times the top one's where logit < max + this."""
        return self.params.temperature[rows] * np.log(self.params.min_p[rows])

    def record(self, rows: np.ndarray, rows_t: torch.Tensor, tokens: torch.Tensor,
               seq_lens: np.ndarray) -> None:
        """Count the sampled tokens of penalized rows that are past their prompt (a prompt
        chunk's sample is not an output token)."""
        counted = self.params.uses_penalties[rows] & (seq_lens >= self.prompt_len[rows])
        if not counted.any():
            return
        assert self.counts is not None and self._flat_counts is not None
        if counted.all():
            # Two calls: the rows' offsets in the flat counts and the ones to add are kept
            # per batch (index_put_ with accumulate sorts its indices: ten times the host time).
            offsets, ones = self._per_batch("count rows", rows, lambda: (
                host_to_device(rows * self.vocab_size, self.device),
                host_to_device(np.ones(len(rows), dtype=np.int32), self.device)))
            self._flat_counts.scatter_add_(0, offsets + tokens, ones)
            return
        which = self._upload("counted rows", np.concatenate([rows, counted]),
                             lambda: np.nonzero(counted)[0])
        self.counts[rows_t[which], tokens[which].long()] += 1


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _widen(old: torch.Tensor | None, shape: tuple[int, ...], fill: int,
           device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor of `shape` filled with `fill`, holding `old` in its leading corner (rows keep
    their entries; entries keep their column)."""
    new = torch.full(shape, fill, dtype=dtype, device=device)
    if old is not None:
        new[tuple(slice(0, n) for n in old.shape)] = old
    return new


@dataclass(frozen=True)
class LogitEdit:
    """One edit of a step's logits: the rows that use it (a host flag per table row) and its
    torch reference; its Triton side is its flag in the edit kernel (`EDIT_FLAGS`, in order)."""

    uses: Callable[[LogitControls], np.ndarray]
    torch_ref: Callable[[LogitControls, torch.Tensor, BatchRows, np.ndarray], None]


# The edits in the order they apply (`SamplingParams`' docstring): penalties, logit bias, bad
# words, then min_p (its floor: the largest edited logit plus the row's offset).
EDITS = (LogitEdit(lambda c: c.params.uses_penalties, LogitControls._penalize),
         LogitEdit(lambda c: c.biased, LogitControls._bias),
         LogitEdit(lambda c: c.banned, LogitControls._ban),
         LogitEdit(lambda c: c.params.uses_min_p, LogitControls._min_p))
