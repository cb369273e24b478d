"""Per-row sampling controls of an engine: penalties, logit bias, bad words, min_p and
log-probabilities, applied on the device between the forward and sampling.

Each table row has its request's settings (host arrays, written on admission) and the state the
controls need on the device, next to the token pool: generated-token counts and a prompt-token
mask (penalties), a padded table of bias entries and one of bad-word sequences. The device
state is allocated on first use and updated from the sampled tokens on the device, so overlap
scheduling needs nothing back from the scheduler. A step in which no row uses a control runs
none of its code: each control checks one host flag per row first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np
import torch

from minisgl_backend.core import ROW_CONTROLS, ROW_DTYPES, penalties_active
from minisgl_backend.device_copy import host_to_device
from minisgl_backend.engine.protocol import LogprobColumns, StepMessage, ranges
from minisgl_backend.layers.fast_ops import use_triton_kernels

if TYPE_CHECKING:  # Triton's kernels are imported where a GPU runs them
    from kernels.logit_edits import EditTables
    from kernels.logprobs import LogprobScratch
    from kernels.sampling import MinPFloor


class RowParams:
    """Every per-row control of `SamplingParams` (`core.ROW_DTYPES`) as a host array per name,
    one entry per table row; rows hold the defaults until a request is admitted to them."""

    def __init__(self, num_rows: int) -> None:
        defaults = {name: -1 if default is None else default
                    for name, (_, default) in ROW_CONTROLS.items()}
        defaults["seed"] = 0
        self.defaults = defaults
        self.arrays = {name: np.full(num_rows, defaults[name], dtype=_host_dtype(dtype))
                       for name, dtype in ROW_DTYPES.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def admit(self, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Rows start new requests: each control takes the sent value (or its default)."""
        for name, array in self.arrays.items():
            array[rows] = values[name] if name in values else self.defaults[name]


T = TypeVar("T")


class PerBatch:
    """Values made once per (what, a batch's rows) and kept until `clear`: decode steps of an
    unchanged batch make nothing again, and an admission, which changes rows' settings,
    clears them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # values kept at most (many batch shapes in a row: start over)
        self._kept: dict[tuple[str, bytes], Any] = {}

    def get(self, what: str, rows: np.ndarray, make: Callable[[], T]) -> T:
        key = (what, rows.tobytes())
        found = self._kept.get(key)
        if found is None:
            if len(self._kept) >= self.limit:
                self._kept.clear()
            found = self._kept[key] = make()
        return found

    def clear(self) -> None:
        self._kept.clear()


def _host_dtype(dtype: str) -> type:
    return np.float64 if dtype.startswith("float") else np.int64


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
    """`LogitControls.begin_logprobs`' launch: the reporting rows (batch indices, on cpu), their
    raw logits, the most top tokens one asks for, the buffers its chunk statistics went into,
    and the side stream they run on (None: the current stream)."""

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


class LogitControls:
    """The controls of one engine. `apply` edits a step's logits before sampling (in place,
    or into a copy when the raw logits must stay for log-probabilities); `record` updates the
    penalty counts from the sampled tokens."""

    def __init__(self, params: RowParams, num_rows: int, vocab_size: int,
                 token_pool: torch.Tensor) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.token_pool = token_pool  # [rows, max_seq_len + 1] int32, the engine's
        self.device = token_pool.device
        self.prompt_len = np.zeros(num_rows, dtype=np.int64)
        # Which rows use which control (host flags: a step checks these before any device work).
        self.penalized = np.zeros(num_rows, dtype=bool)
        self.biased = np.zeros(num_rows, dtype=bool)
        self.banned = np.zeros(num_rows, dtype=bool)
        self.min_p_rows = np.zeros(num_rows, dtype=bool)
        # any of the above: `apply` edits the rows' logits (and `record` counts penalized ones)
        self.edited = np.zeros(num_rows, dtype=bool)
        # log-probabilities or generation logits reported: the raw logits are read, not edited
        self.reported = np.zeros(num_rows, dtype=bool)
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
        # Per-batch device copies of host values (row indices, factors), by what they are.
        self._uploads = PerBatch(limit=256)
        self._lp_buffers: dict[tuple[int, int], _LogprobBuffers] = {}  # (rows, top)
        self._stream: torch.cuda.Stream | None = None  # `begin_logprobs`' side stream

    def _upload(self, what: str, key: np.ndarray, make: Callable[[], np.ndarray],
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """`make()` on the device, uploaded once per (what, key) until the next admission."""
        return self._uploads.get(what, key, lambda: host_to_device(make(), self.device, dtype))

    # ----- admission ---------------------------------------------------------------------

    def admit(self, msg: StepMessage) -> None:
        """Rows of `msg.admit_rows` start new requests: set their flags and device state."""
        rows = np.asarray(msg.admit_rows, dtype=np.int64)
        self._uploads.clear()
        p = self.params
        self.penalized[rows] = penalties_active(p["repetition_penalty"][rows],
                                                p["presence_penalty"][rows],
                                                p["frequency_penalty"][rows])
        self.min_p_rows[rows] = (p["min_p"][rows] > 0) & (p["temperature"][rows] > 0)
        was_biased, was_banned = self.biased[rows].copy(), self.banned[rows].copy()
        self.biased[rows] = False
        self.banned[rows] = False
        if self.penalized[rows].any():
            self._reset_penalty_state(rows[self.penalized[rows]])
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
        self.edited[rows] = (self.penalized[rows] | self.biased[rows] | self.banned[rows]
                             | self.min_p_rows[rows])
        self.reported[rows] = (p["logprobs"][rows] >= 0) | (p["return_generation_logits"][rows] > 0)

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
        penalized = self.penalized[row_of]
        if penalized.any():
            keep = host_to_device(np.nonzero(penalized)[0], self.device)
            self.in_prompt[row_t[keep], tokens[keep]] = True

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

    def raw_logprobs(self, logits: torch.Tensor, rows: np.ndarray) -> RawLogprobs | None:
        """What the rows reporting log-probabilities need of the raw logits, taken before masks
        (grammars, min_tokens) set some of them to -inf in place; None if no row asks.
        `report` completes it after sampling: a mask leaves the sampled tokens' logits raw."""
        reporting = self._reporting(logits, rows)
        if reporting is None:
            return None
        wanted, sel, top = reporting
        if not _kernels_edit(sel):
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
        """On a GPU, the first half of `sampled_logprobs`, launched now on a side stream: the
        raw `logits`' chunk statistics run beside the edits and sampling, which do not change
        `logits` (`apply` with `keep_raw`), instead of after them. None if no row asks, or
        off the kernels' path (`sampled_logprobs` then does it all)."""
        if not _kernels_edit(logits):
            return None
        return self._chunk_statistics(logits, rows, self._side_stream())

    def sampled_logprobs(self, logits: torch.Tensor, rows: np.ndarray,
                         tokens: torch.Tensor, pending: PendingLogprobs | None = None
                         ) -> LogprobReport | None:
        """`raw_logprobs` and `report` in one go, after sampling, from the raw `logits` (no
        control or mask changed them: `apply` with `keep_raw` edits a copy): on a GPU the
        kernels then write the sampled tokens' column too. `pending`: what `begin_logprobs`
        launched for these logits (its second half follows). None if no row asks."""
        if not _kernels_edit(logits):
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

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _reporting(self, logits: torch.Tensor, rows: np.ndarray
                   ) -> tuple[np.ndarray, torch.Tensor, int] | None:
        """The batch indices of the rows that report log-probabilities, their logits and the
        most top tokens one asks for; None if no row asks."""
        logprobs = self.params["logprobs"][rows]
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
        steps (the steps run in order on one stream: a step's table is copied to the host
        before the next step writes it)."""
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
        """Penalties, bias, bad words and min_p on `logits` [bs, vocab], in that order. Returns
        the logits to sample from: `logits` edited in place, or with `keep_raw` an edited copy
        (`logits` then stay raw for the log-probabilities); and, with `leave_floor`, min_p's
        floor where the kernels left it to sampling (`kernels.sampling.MinPFloor`: the
        sampler applies it), else None. `next_positions` [bs] (device) and `seq_lens` [bs]
        (host): positions of the tokens being sampled."""
        if _kernels_edit(logits):
            return self._apply_kernels(logits, rows, rows_t, next_positions, keep_raw,
                                       leave_floor)
        if keep_raw:
            logits = logits.clone()
        penalized = self.penalized[rows]
        if penalized.any():
            self._penalize(logits, rows, penalized, seq_lens, next_positions)
        if self.biased[rows].any():
            assert self.bias_ids is not None and self.bias_values is not None
            logits.scatter_add_(1, self.bias_ids[rows_t],
                                self.bias_values[rows_t].to(logits.dtype))
        if self.banned[rows].any():
            self._ban(logits, rows_t, next_positions)
        min_p = self.min_p_rows[rows]
        if min_p.any():
            self._min_p(logits, rows, min_p)
        return logits, None

    def _apply_kernels(self, logits: torch.Tensor, rows: np.ndarray, rows_t: torch.Tensor,
                       next_positions: torch.Tensor, keep_raw: bool, leave_floor: bool
                       ) -> tuple[torch.Tensor, MinPFloor | None]:
        """`apply` on a GPU: every edit in one kernel, min_p's floor in a second or in the
        sampling kernels (`kernels/logit_edits.py`)."""
        from kernels.logit_edits import apply_edits

        edits = self._uploads.get("edit rows" if keep_raw else "edited rows", rows,
                                  lambda: self._edit_rows(rows, keep_raw))
        out = torch.empty_like(logits) if keep_raw else logits
        apply_edits(logits, out, edits.program_rows, rows_t, next_positions, edits.factors,
                    edits.tables, edits.flags, min_p=edits.min_p, floor=not leave_floor)
        return out, edits.min_p if leave_floor else None

    def _edit_rows(self, rows: np.ndarray, every_row: bool) -> _EditRows:
        """The edit kernels' rows of a batch: its edited rows, or `every_row` (a copy is
        written: rows without edits are copied)."""
        from kernels import logit_edits as k

        which = np.arange(len(rows)) if every_row else np.nonzero(self.edited[rows])[0]
        sel = rows[which]
        flags = (k.PENALTIES * self.penalized[sel] + k.BIAS * self.biased[sel]
                 + k.BANS * self.banned[sel] + k.MIN_P * self.min_p_rows[sel])
        p = self.params
        factors = np.zeros((len(sel), k.FACTORS), dtype=np.float32)
        penalized = self.penalized[sel]
        factors[:, k.REPETITION] = np.where(penalized, p["repetition_penalty"][sel], 1.0)
        factors[:, k.PRESENCE] = np.where(penalized, p["presence_penalty"][sel], 0.0)
        factors[:, k.FREQUENCY] = np.where(penalized, p["frequency_penalty"][sel], 0.0)
        uses_min_p = self.min_p_rows[sel]  # per program row
        min_p = sel[uses_min_p]
        factors[uses_min_p, k.MIN_P_OFFSET] = min_p_offset(p["temperature"][min_p],
                                                           p["min_p"][min_p])
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

    def _penalize(self, logits: torch.Tensor, rows: np.ndarray, penalized: np.ndarray,
                  seq_lens: np.ndarray, next_positions: torch.Tensor) -> None:
        assert self.counts is not None and self.in_prompt is not None
        which = np.nonzero(penalized)[0]
        p = self.params
        sel_rows = rows[which]
        rep, presence, frequency = self._upload("penalties", rows, lambda: np.stack(
            [p["repetition_penalty"][sel_rows], p["presence_penalty"][sel_rows],
             p["frequency_penalty"][sel_rows]]), torch.float32).unsqueeze(2)
        which_t, row_t = self._upload("penalized rows", rows,
                                      lambda: np.stack([which, sel_rows]), torch.int64)
        lens = seq_lens[which]
        if 2 * int(lens.max()) < self.vocab_size:
            # Only the tokens a row has seen change: its token pool row holds them all (the
            # prompt came on admission). Repeated ids write the same value, so scatter is exact.
            last = next_positions[which_t].unsqueeze(1) - 1  # each row's last position
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
        # HF's repetition penalty: positive logits divided by it, negative ones multiplied.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - frequency * counts - presence * (counts > 0)
        logits[which_t] = sub.to(logits.dtype)

    def _ban(self, logits: torch.Tensor, rows_t: torch.Tensor,
             next_positions: torch.Tensor) -> None:
        """Mask every sequence's last token where the tokens before it end the row so far."""
        assert self.ban_tokens is not None
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

    def _min_p(self, logits: torch.Tensor, rows: np.ndarray, which_mask: np.ndarray) -> None:
        """Drop tokens whose probability at the row's temperature is below min_p times the
        top one's: logit < max + temperature * log(min_p)."""
        which = np.nonzero(which_mask)[0]
        sel_rows = rows[which]
        p = self.params
        offset_t = self._upload("min_p", rows, lambda: min_p_offset(
            p["temperature"][sel_rows], p["min_p"][sel_rows]), torch.float32).unsqueeze(1)
        if len(which) == len(rows):
            floor = logits.amax(dim=-1, keepdim=True).float() + offset_t
            logits.masked_fill_(logits < floor, float("-inf"))
            return
        idx = self._upload("min_p rows", rows, lambda: which)
        sub = logits[idx]
        floor = sub.amax(dim=-1, keepdim=True).float() + offset_t
        logits[idx] = sub.masked_fill(sub < floor, float("-inf"))

    def record(self, rows: np.ndarray, rows_t: torch.Tensor, tokens: torch.Tensor,
               seq_lens: np.ndarray) -> None:
        """Count the sampled tokens of penalized rows that are past their prompt (a prompt
        chunk's sample is not an output token)."""
        counted = self.penalized[rows] & (seq_lens >= self.prompt_len[rows])
        if not counted.any():
            return
        assert self.counts is not None and self._flat_counts is not None
        if counted.all():
            # Two calls: the rows' offsets in the flat counts and the ones to add are kept
            # per batch (index_put_ with accumulate sorts its indices: ten times the host time).
            offsets, ones = self._uploads.get("count rows", rows, lambda: (
                host_to_device(rows * self.vocab_size, self.device),
                host_to_device(np.ones(len(rows), dtype=np.int32), self.device)))
            self._flat_counts.scatter_add_(0, offsets + tokens, ones)
            return
        which = self._upload("counted rows", np.concatenate([rows, counted]),
                             lambda: np.nonzero(counted)[0])
        self.counts[rows_t[which], tokens[which].long()] += 1


def min_p_offset(temperature: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """How far below a row's largest logit min_p drops tokens: a token's probability at the
    row's temperature is below min_p times the top one's where logit < max + this."""
    return temperature * np.log(min_p)


def _kernels_edit(logits: torch.Tensor) -> bool:
    """The project's Triton kernels edit these logits (a GPU; unit stride along the
    vocabulary), not the torch path."""
    return use_triton_kernels(logits) and logits.stride(1) == 1


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
