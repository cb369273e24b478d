"""Decode steps replayed from CUDA graphs.

A decode step launches hundreds of small kernels; at small batch sizes their launch overhead
exceeds their run time. Each batch size in a list is captured once (largest first, all graphs
sharing one memory pool); a decode batch is padded with dummy requests up to the next captured
size, its inputs are copied into the graphs' static tensors, the attention backend updates its
metadata in place, and the graph is replayed.
"""

from __future__ import annotations

import bisect

import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.core import Batch, Context


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, ctx: Context, backend: AttentionBackend,
                 max_bs: int, page_table: torch.Tensor, dummy_slot: int) -> None:
        self.model = model
        self.ctx = ctx
        self.backend = backend
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.page_table = page_table
        self.dummy_row = dummy_row = page_table.shape[0] - 1  # maps every page to the dummy page
        self.dummy_slot = dummy_slot
        device = page_table.device
        # Static inputs: dummy requests (dummy row, position 0, the dummy KV slot) by default.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_slots = torch.full((self.max_bs,), dummy_slot, dtype=torch.int64, device=device)
        self.rows = torch.full((self.max_bs,), dummy_row, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        backend.init_cuda_graph(self.max_bs)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._capture(bs, pool)

    def _static_batch(self, bs: int, seq_lens: list[int]) -> Batch:
        return Batch(phase="decode", rows=self.rows[:bs], input_ids=self.input_ids[:bs],
                     positions=self.positions[:bs], out_slots=self.out_slots[:bs],
                     extend_lens=[1] * bs, seq_lens=seq_lens)

    def _capture(self, bs: int, pool: tuple) -> None:
        batch = self._static_batch(bs, [1] * bs)
        self.backend.prepare_for_capture(batch, self.page_table)
        with self.ctx.forward_batch(batch):
            self.model()  # warm-up: lazy initialization and kernel selection happen outside
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model()
        self.graphs[bs] = graph
        self.logits[bs] = logits

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def run(self, batch: Batch, page_table: torch.Tensor) -> torch.Tensor:
        """Logits [batch.size, vocab] of a decode batch (a view of the graph's output)."""
        n = batch.size
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.rows[:n].copy_(batch.rows)
        if bs > n:  # the padding rows may hold a real request's values from an earlier step
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_slots[n:bs].fill_(self.dummy_slot)
            self.rows[n:bs].fill_(self.dummy_row)
        padded = self._static_batch(bs, list(batch.seq_lens) + [1] * (bs - n))
        self.backend.prepare_for_replay(padded, page_table)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
