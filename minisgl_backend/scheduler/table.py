"""Rows of the engine's page table and token pool, one per running request."""

from __future__ import annotations


class RowAllocator:
    """Hands out rows 0..n-1; row n is the engine's dummy row and is never handed out."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def dummy_row(self) -> int:
        return self.num_rows

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)
