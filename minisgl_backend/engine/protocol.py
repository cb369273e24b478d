"""The messages between the scheduler and the engine processes, as compact bytes (no pickle).

A message is a kind byte followed by named numpy arrays; a decode step for 256 requests is about
a kilobyte. Only what changed travels: rows in the batch, prompt tokens never sent before, page
ids newly added to a row, and sampling settings when a request is admitted to a row.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

# Message kinds, scheduler -> engine. With overlap on, the engine answers a STEP with the tokens
# of the step before it (the new one is already running); FLUSH asks for the last step's tokens.
STEP, SHUTDOWN, FLUSH = 1, 2, 3
# Reply kinds, engine -> scheduler.
READY, TOKENS, ERROR = 11, 12, 13

_DTYPES = [np.dtype(t) for t in ("int32", "int64", "float32", "uint8")]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_FIELD_HEADER = struct.Struct("<BBI")  # name length, dtype code, element count


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


def _i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


@dataclass
class StepMessage:
    """One forward step. Arrays are per request in batch order unless noted.

    A prefill step may end with decode rows ("mixed" steps): `rows` beyond the first
    `len(starts)` each compute one token, the one the engine sampled last for that row (taken
    from its token pool, like a decode step's)."""

    is_prefill: bool
    rows: list[int]
    # Prefill only, for its prefill rows: first position computed this step and number of
    # tokens computed.
    starts: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prefill: the prompt tokens computed
    # Pages appended to rows, only for rows that get any: row, count, and the flat page ids.
    page_rows: list[int] = field(default_factory=list)
    page_counts: list[int] = field(default_factory=list)
    new_pages: list[int] = field(default_factory=list)
    # Admissions (a row starts a new request): per admitted row, its sampling settings.
    admit_rows: list[int] = field(default_factory=list)
    admit_temperature: list[float] = field(default_factory=list)
    admit_top_k: list[int] = field(default_factory=list)
    admit_top_p: list[float] = field(default_factory=list)
    admit_seed: list[int] = field(default_factory=list)  # int64 bit pattern of a uint64 seed
    # Requests with min_tokens: row, position before which stop ids are masked, and the ids.
    min_rows: list[int] = field(default_factory=list)
    min_lens: list[int] = field(default_factory=list)
    min_stop_counts: list[int] = field(default_factory=list)
    min_stop_ids: list[int] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        arrays = {
            "is_prefill": np.asarray([self.is_prefill], dtype=np.uint8),
            "rows": _i32(self.rows),
            "page_rows": _i32(self.page_rows),
            "page_counts": _i32(self.page_counts),
            "new_pages": _i32(self.new_pages),
        }
        if self.is_prefill:
            arrays.update(starts=_i32(self.starts), extend_lens=_i32(self.extend_lens),
                          tokens=_i32(self.tokens))
        if self.admit_rows:
            arrays.update(
                admit_rows=_i32(self.admit_rows),
                admit_temperature=np.asarray(self.admit_temperature, dtype=np.float32),
                admit_top_k=_i32(self.admit_top_k),
                admit_top_p=np.asarray(self.admit_top_p, dtype=np.float32),
                admit_seed=np.asarray(self.admit_seed, dtype=np.int64),
            )
        if self.min_rows:
            arrays.update(min_rows=_i32(self.min_rows), min_lens=_i32(self.min_lens),
                          min_stop_counts=_i32(self.min_stop_counts),
                          min_stop_ids=_i32(self.min_stop_ids))
        return encode(STEP, arrays)
