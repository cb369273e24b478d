"""Prefill with one attention backend and decode with another (both over the same KV pool)."""

from __future__ import annotations

import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.core import Batch


class HybridAttentionBackend(AttentionBackend):
    """Steps go to the backend of their phase; decode CUDA graphs are the decode backend's."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.supports_cuda_graph = decode.supports_cuda_graph

    def _backend(self, batch: Batch) -> AttentionBackend:
        return self.decode_backend if batch.is_decode else self.prefill_backend

    def prepare(self, batch: Batch, page_table: torch.Tensor) -> None:
        self._backend(batch).prepare(batch, page_table)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
        batch: Batch, window: int = 0,
    ) -> torch.Tensor:
        return self._backend(batch).forward(q, k, v, layer_id, batch, window)

    def init_cuda_graph(self, max_bs: int) -> None:
        self.decode_backend.init_cuda_graph(max_bs)

    def prepare_for_capture(self, batch: Batch, page_table: torch.Tensor) -> None:
        self.decode_backend.prepare_for_capture(batch, page_table)

    def prepare_for_replay(self, batch: Batch, page_table: torch.Tensor) -> None:
        self.decode_backend.prepare_for_replay(batch, page_table)
