"""The attention backend interface: prepare metadata once per step, then forward per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl_backend.core import Batch


class AttentionBackend(ABC):
    """Each backend reads K/V of earlier tokens from the paged pool through the page table.

    `prepare(batch)` runs once per step and stores whatever the kernels need in
    `batch.attn_metadata`; `forward` stores this step's K/V in the pool and attends.
    """

    @abstractmethod
    def prepare(self, batch: Batch, page_table: torch.Tensor) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] -> [tokens, heads * dim]."""
