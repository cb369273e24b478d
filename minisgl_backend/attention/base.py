"""The attention backend interface: prepare metadata once per step, then forward per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl_backend.core import Batch


class AttentionBackend(ABC):
    """Each backend reads K/V of earlier tokens from the paged pool through the page table.

    `prepare(batch, page_table)` runs once per step and stores whatever the kernels need in
    `batch.attn_metadata`; `forward` stores this step's K/V in the pool (unless the caller
    already did, passing `k = v = None`) and attends. A sliding-window layer passes its
    `window` (each query attends to its last `window` tokens, itself included; HF's
    `sliding_window`); full-attention layers make the call without it. The K/V of tokens
    that left the window stay in the pool.

    Decode steps can be replayed from CUDA graphs when `supports_cuda_graph` is True. The
    engine then calls `init_cuda_graph(max_bs)` once, `prepare_for_capture(batch, page_table)`
    before capturing each batch size (the batch holds the graph's static tensors and dummy rows;
    the page table is the engine's one table, which captured kernels may read by address), and
    `prepare_for_replay(batch, page_table)` before every replay: it must update, in place, the
    metadata tensors that the captured kernels read, and run no kernel whose launch shape
    depends on the batch's contents.
    """

    supports_cuda_graph: bool = False

    @abstractmethod
    def prepare(self, batch: Batch, page_table: torch.Tensor) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
        batch: Batch, window: int = 0,
    ) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] or None (already in the pool)
        -> [tokens, heads * dim]. `window`: see the class docstring (0: full attention)."""

    def init_cuda_graph(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch, page_table: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch, page_table: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
