"""The messages between the scheduler and the engine processes, as compact bytes (no pickle).

A message is a kind byte followed by named numpy arrays; a decode step for 256 requests is about
a kilobyte. Only what changed travels: rows in the batch, prompt tokens never sent before, page
ids newly added to a row, and sampling settings when a request is admitted to a row.
TOKENS replies are `StepReply`s.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np

from minisgl_backend.core import RowSampling

# Message kinds, scheduler -> engine. The engine answers every STEP with its tokens once they
# are on the host (with overlap on, the scheduler has sent the next STEP by then). MASKS follows
# a STEP sent with `masks_follow` (after the STEP after it, if any): its guided rows' token
# masks are written.
STEP, SHUTDOWN, MASKS = 1, 2, 4
# Reply kinds, engine -> scheduler.
READY, TOKENS, ERROR = 11, 12, 13

_DTYPES = [np.dtype(t) for t in ("int32", "int64", "float32", "uint8", "bool")]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_FIELD_HEADER = struct.Struct("<BBI")  # name length, dtype code, element count
# A sampled token's log-probability, and its step's most likely ids and theirs (tuples: kept
# per token until a request's end, they stay out of the garbage collector's way; see
# `scheduler.output._Delta`).
Logprobs = tuple[float, tuple[int, ...], tuple[float, ...]]


def encode(kind: int, arrays: dict[str, np.ndarray]) -> bytes:
    parts = [bytes([kind])]
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        raw_name = name.encode()
        parts.append(_FIELD_HEADER.pack(len(raw_name), _DTYPE_CODE[array.dtype], array.size))
        parts.append(raw_name)
        parts.append(array.tobytes())
    return b"".join(parts)


def decode(data: bytes) -> tuple[int, dict[str, np.ndarray]]:
    kind, offset, arrays = data[0], 1, {}
    view = memoryview(data)
    while offset < len(data):
        name_len, code, count = _FIELD_HEADER.unpack_from(data, offset)
        offset += _FIELD_HEADER.size
        name = bytes(view[offset : offset + name_len]).decode()
        offset += name_len
        dtype = _DTYPES[code]
        arrays[name] = np.frombuffer(view, dtype=dtype, count=count, offset=offset)
        offset += count * dtype.itemsize
    return kind, arrays


def ranges(starts: np.ndarray | int, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n): the positions of a ragged array's
    flat elements (`ranges(0, counts)`: each element's index within its group)."""
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(int(lengths.sum()))


def _array(dtype: str):  # noqa: ANN202 - a dataclass field
    return field(default_factory=list, metadata={"dtype": dtype})


Values = list | np.ndarray  # lists when built by the scheduler, numpy arrays once decoded


@dataclass
class StepMessage:
    """One forward step, the same typed object on both ends (`to_bytes` / `from_bytes`).
    Arrays are per request in batch order unless noted; empty ones are not sent.

    The first `len(starts)` rows send their tokens (`extend_lens` from `starts`); the others
    each compute one token, the one the engine sampled last for that row (from its token pool).
    In a prefill step the first rows are prompt chunks (and decode rows may follow: "mixed"
    steps); each row samples one token. A decode step has such rows only with speculative
    decoding: a row's last sampled token followed by its drafts (or alone, after rejected
    drafts moved the row's length back), and each of its tokens samples one (a "sample" each:
    the reply's tokens, log-probability and logits rows, and the guided rows, are per sample,
    in batch order)."""

    is_prefill: bool
    rows: Values = _array("int32")
    # For the first rows (see above): first position computed this step, tokens computed.
    starts: Values = _array("int32")
    extend_lens: Values = _array("int32")
    tokens: Values = _array("int32")  # the tokens those rows compute
    # Pages appended to rows, only for rows that get any: row, count, and the flat page ids.
    page_rows: Values = _array("int32")
    page_counts: Values = _array("int32")
    new_pages: Values = _array("int32")
    # Admissions (a row starts a new request): the rows, and their per-row controls, sent as
    # `admit_<name>` arrays.
    admit_rows: Values = _array("int32")
    admit: RowSampling | None = None
    # Admitted rows whose whole prompt the engine needs (repetition penalty, bad-word prefixes
    # that may reach into a cached prefix): row, prompt length, the flat prompt tokens.
    prompt_rows: Values = _array("int32")
    prompt_counts: Values = _array("int32")
    prompt_tokens: Values = _array("int32")
    # logit_bias of admitted rows: row, entries, flat token ids and values.
    bias_rows: Values = _array("int32")
    bias_counts: Values = _array("int32")
    bias_ids: Values = _array("int32")
    bias_values: Values = _array("float32")
    # Bad-word sequences of admitted rows, one entry per sequence: row, length, flat tokens.
    ban_rows: Values = _array("int32")
    ban_lens: Values = _array("int32")
    ban_tokens: Values = _array("int32")
    # Requests with min_tokens: row, position before which stop ids are masked, and the ids.
    min_rows: Values = _array("int32")
    min_lens: Values = _array("int32")
    min_stop_counts: Values = _array("int32")
    min_stop_ids: Values = _array("int32")
    # LongRoPE: rows whose KV is computed in the long frequencies from this step on (admitted
    # with a prompt past the pretraining length, or restarted: a request crossing it is
    # computed whole again, its page list starting over); per row, the tokens up to which its
    # samples are prompt chunks' (not output tokens, for the penalties' counts).
    long_rope_rows: Values = _array("int32")
    long_rope_lens: Values = _array("int32")
    # LoRA: adapters whose host copies the engine frees (read again when needed); adapters it
    # reads (first used, or freed before: id, and the folder's path as UTF-8 bytes,
    # concatenated, with each path's length); adapters copied into device slots before this
    # step (slot, adapter id from 1); the admitted rows that take one (row, slot), other
    # admitted rows taking none.
    lora_drop_ids: Values = _array("int32")
    lora_read_ids: Values = _array("int32")
    lora_read_paths: Values = _array("uint8")
    lora_read_path_lens: Values = _array("int32")
    lora_load_slots: Values = _array("int32")
    lora_load_ids: Values = _array("int32")
    lora_rows: Values = _array("int32")
    lora_slots: Values = _array("int32")
    # Prefill rows (batch indices) whose computed tokens' logits come back (prompt logits).
    context_rows: Values = _array("int32")
    # Structured output: the rows (batch indices) whose next token a grammar constrains, and
    # the half of the shared mask buffer (`mask_buffer.MaskBuffer`) holding their token masks
    # (one value: 0 or 1), written before this message is sent.
    guide_rows: Values = _array("int32")
    mask_half: Values = _array("uint8")
    # With overlap on, a guided row's mask needs the token of the step before, which the
    # scheduler reads while this step's forward runs: the masks are then written after this
    # message (and after the next step's message), a MASKS message (`masks_ready`) says they
    # are, and the engine waits for it only to sample. On a GPU the device waits instead: the
    # scheduler then also writes `mask_seq` (one value, counting such steps from 1) into the
    # mask buffer's ready word (`MaskBuffer.mark_ready`).
    mask_seq: Values = _array("int64")
    masks_follow: bool = False

    def to_bytes(self) -> bytes:
        arrays = {"is_prefill": np.asarray([self.is_prefill], dtype=np.uint8)}
        if self.masks_follow:
            arrays["masks_follow"] = np.ones(1, dtype=np.uint8)
        for f in _ARRAY_FIELDS:
            values = getattr(self, f.name)
            if len(values) or f.name in _ALWAYS_SENT:
                arrays[f.name] = np.asarray(values, dtype=f.metadata["dtype"])
        if self.admit is not None:
            arrays.update(self.admit.to_arrays(_ADMIT_PREFIX))
        return encode(STEP, arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMessage:
        kind, arrays = decode(data)
        if kind != STEP:
            raise ValueError(f"not a step message (kind {kind})")
        return cls.from_arrays(arrays)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> StepMessage:
        # Every field set here (a decode step's message is decoded each step: no default
        # factories run); absent array fields share one read-only empty array each.
        msg = cls.__new__(cls)
        msg.is_prefill = bool(arrays["is_prefill"][0])
        msg.masks_follow = "masks_follow" in arrays
        for name, empty in _EMPTY_FIELDS.items():
            setattr(msg, name, arrays.get(name, empty))
        msg.admit = (RowSampling.from_arrays(arrays, _ADMIT_PREFIX) if "admit_rows" in arrays
                     else None)
        return msg


def masks_ready(seq: int) -> bytes:
    """The MASKS message that follows the step sent with `masks_follow` and `mask_seq` `seq`,
    once its masks are written."""
    return encode(MASKS, {"mask_seq": np.asarray([seq], dtype=np.int64)})


_ARRAY_FIELDS = [f for f in fields(StepMessage) if "dtype" in f.metadata]
_EMPTY_FIELDS = {f.name: np.zeros(0, dtype=f.metadata["dtype"]) for f in _ARRAY_FIELDS}
for _empty in _EMPTY_FIELDS.values():
    _empty.flags.writeable = False
# `from_arrays` sets these and the array fields, nothing else.
assert {f.name for f in fields(StepMessage)} - set(_EMPTY_FIELDS) == {
    "is_prefill", "masks_follow", "admit"}
_ALWAYS_SENT = {"rows", "page_rows", "page_counts", "new_pages"}
_ADMIT_PREFIX = "admit_"


@dataclass(frozen=True)
class LogprobColumns:
    """The columns of a step's log-probability table, one float32 row per sample that asked
    (one table, so one device-to-host copy a step): the sampled token's log-probability, the
    `top` most likely tokens' log-probabilities (descending), then their ids, stored as int32
    bit patterns. The engine fills it on the device; `StepReply.logprobs_of` reads it."""

    top: int
    token: ClassVar[int] = 0  # the sampled token's column

    @classmethod
    def of_width(cls, width: int) -> LogprobColumns:
        return cls((width - 1) // 2)

    @property
    def width(self) -> int:
        return 1 + 2 * self.top

    @property
    def top_logprobs(self) -> slice:
        return slice(1, 1 + self.top)

    @property
    def top_ids(self) -> slice:
        return slice(1 + self.top, 1 + 2 * self.top)


@dataclass
class StepReply:
    """What rank 0 answers a step with: the sampled token per sample (batch order; see
    `StepMessage`), and for the samples that asked for log-probabilities (`lp_rows`: their
    indices) one row each of `logprobs` (`LogprobColumns`: the sampled token's
    log-probability, then the `top` most likely tokens' and their ids)."""

    tokens: np.ndarray  # int32 [bs]
    lp_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # row-major
    # Raw logits (float32, row-major [*, vocabulary]): of the sampled token for the rows that
    # return generation logits (`logit_rows`, batch indices), and of every token the step
    # computed for the rows that return prompt logits (`context_rows`, `context_counts`).
    logit_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    context_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    context_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    context_logits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    def to_bytes(self) -> bytes:
        arrays = {"tokens": np.asarray(self.tokens, dtype=np.int32)}
        if len(self.lp_rows):
            arrays.update(lp_rows=np.asarray(self.lp_rows, dtype=np.int32),
                          logprobs=np.asarray(self.logprobs, dtype=np.float32).reshape(-1))
        if len(self.logit_rows):
            arrays.update(logit_rows=np.asarray(self.logit_rows, dtype=np.int32),
                          logits=np.asarray(self.logits, dtype=np.float32).reshape(-1))
        if len(self.context_rows):
            arrays.update(context_rows=np.asarray(self.context_rows, dtype=np.int32),
                          context_counts=np.asarray(self.context_counts, dtype=np.int32),
                          context_logits=np.asarray(self.context_logits,
                                                    dtype=np.float32).reshape(-1))
        return encode(TOKENS, arrays)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> StepReply:
        return cls(**arrays)

    def generation_logits_of(self) -> dict[int, np.ndarray]:
        """batch index -> the sampled token's raw logits [vocabulary]."""
        if not len(self.logit_rows):
            return {}
        rows = self.logits.reshape(len(self.logit_rows), -1)
        return {int(r): rows[i] for i, r in enumerate(self.logit_rows)}

    def context_logits_of(self) -> dict[int, np.ndarray]:
        """batch index -> the logits of the tokens the step computed for it [tokens, vocab]."""
        if not len(self.context_rows):
            return {}
        counts = np.asarray(self.context_counts, dtype=np.int64)
        table = self.context_logits.reshape(int(counts.sum()), -1)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        return {int(r): table[bounds[i]:bounds[i + 1]] for i, r in enumerate(self.context_rows)}

    def logprobs_of(self) -> dict[int, Logprobs]:
        """batch index -> (token log-probability, top ids, top log-probabilities)."""
        table = np.asarray(self.logprobs, dtype=np.float32).reshape(len(self.lp_rows), -1)
        cols = LogprobColumns.of_width(table.shape[1])
        ids = table[:, cols.top_ids].view(np.int32).tolist()
        vals = table[:, cols.top_logprobs].tolist()
        return {int(r): (float(t), tuple(i), tuple(v))
                for r, t, i, v in zip(self.lp_rows, table[:, cols.token], ids, vals)}
