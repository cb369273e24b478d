"""Decode steps replayed from CUDA graphs.

A decode step launches hundreds of small kernels; at small batch sizes their launch overhead
exceeds their run time. Each batch size in a list is captured once (largest first, all graphs
sharing one memory pool); a decode batch is padded with dummy requests up to the next captured
size and replayed.

The host prepares a step in one copy: `stage` writes the step's table rows, positions, KV slots,
lengths and new page-table entries (all computed on the host) into one pinned array, padded with
dummy requests, and copies it into the graphs' static input tensor. The graph itself gathers the
input ids from the engine's token pool, so a step costs the host two launches before the replay
(the copy and the engine's page-table update) instead of one per input tensor.

An engine serving LoRA adapters captures each size twice: without adapters (what a batch of
base-model rows replays, paying nothing for LoRA) and with the adapter kernels reading a static
block table (`kernels/lora.py`), which `stage` fills for a step whose rows take adapters.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.core import Batch, Context
from minisgl_backend.lora.ops import LoraRows


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


# The rows of the staged input tensor, in order.
STAGED_ROWS = ("rows", "positions", "out_slots", "seq_lens", "page_index", "page_value")
_ROWS, _POSITIONS, _OUT_SLOTS, _SEQ_LENS, _PAGE_INDEX, _PAGE_VALUE = range(len(STAGED_ROWS))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, ctx: Context, backend: AttentionBackend,
                 max_bs: int, page_table: torch.Tensor, token_pool: torch.Tensor,
                 dummy_page: int, page_size: int, lora_slots: int = 0) -> None:
        self.model = model
        self.ctx = ctx
        self.backend = backend
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.page_table = page_table
        self.token_pool = token_pool
        dummy_row = page_table.shape[0] - 1  # maps every page to the dummy page
        device = page_table.device
        # Padding: dummy requests (dummy row, position 0, the dummy KV slot, length 0 which
        # attends to nothing). Only a step's own page-table entries are applied.
        self._padding = np.zeros((len(STAGED_ROWS), self.max_bs), dtype=np.int64)
        self._padding[_ROWS] = dummy_row
        self._padding[_OUT_SLOTS] = dummy_page * page_size
        self.staged = torch.from_numpy(self._padding).to(device)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.lora_slots = lora_slots
        if lora_slots:
            from kernels.lora import max_blocks

            self._lora_blocks = max_blocks(self.max_bs, lora_slots)
            self.lora_table = torch.zeros(self.max_bs + 3 * self._lora_blocks,
                                          dtype=torch.int64, device=device)
            # A staged step's LoRA rows: the whole table (`run` replays the LoRA graph for it).
            self.staged_lora = self.lora_rows(self.max_bs)
        # Keyed by (batch size, whether the graph adds the LoRA delta).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        backend.init_cuda_graph(self.max_bs)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._capture(bs, pool)

    def fits(self, count: int) -> bool:
        """Whether this many entries (or new page-table entries) of a decode step fit the
        graphs' static inputs."""
        return count <= self.max_bs

    def stage(self, columns: Sequence[np.ndarray], page_index: np.ndarray,
              page_value: np.ndarray, lora_slots: np.ndarray | None = None
              ) -> tuple[torch.Tensor, ...]:
        """Upload a decode step's rows, positions, out slots and seq_lens (`columns`, in that
        order, one entry each) and its new page-table entries (flat indices into the table,
        page ids; at most `max_bs`) in one copy. Returns device views of the six (the caller
        enters the pages in its table). `lora_slots`: each entry's adapter slot (-1: none), for
        a step that replays the LoRA graphs."""
        if lora_slots is not None:
            self._stage_lora(lora_slots)
        n, m = len(columns[0]), len(page_index)
        assert n <= self.max_bs and m <= self.max_bs, f"{n} entries, {m} pages > {self.max_bs}"
        host = torch.empty(self._padding.shape, dtype=torch.int64, pin_memory=True)
        array = host.numpy()
        array[:] = self._padding
        for i, column in enumerate(columns):
            array[i, :n] = column
        array[_PAGE_INDEX, :m] = page_index
        array[_PAGE_VALUE, :m] = page_value
        # The caching host allocator keeps `host` until this copy has run.
        self.staged.copy_(host, non_blocking=True)
        return (*(self.staged[i, :n] for i in (_ROWS, _POSITIONS, _OUT_SLOTS, _SEQ_LENS)),
                self.staged[_PAGE_INDEX, :m], self.staged[_PAGE_VALUE, :m])

    def _stage_lora(self, token_slots: np.ndarray) -> None:
        from kernels.lora import pack_blocks

        packed, _ = pack_blocks(token_slots, self.max_bs, self._lora_blocks)
        host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = packed
        # The caching host allocator keeps `host` until this copy has run.
        self.lora_table.copy_(host, non_blocking=True)

    def lora_rows(self, bs: int) -> LoraRows:
        """The LoRA graphs' view of the static block table for graphs of `bs` entries."""
        from kernels.lora import max_blocks, split_blocks

        return LoraRows([], split_blocks(self.lora_table, self.max_bs, self._lora_blocks,
                                         max_blocks(bs, self.lora_slots)))

    def _static_batch(self, bs: int, seq_lens: list[int]) -> Batch:
        staged = self.staged
        return Batch(phase="decode", rows=staged[_ROWS, :bs], input_ids=self.input_ids[:bs],
                     positions=staged[_POSITIONS, :bs], out_slots=staged[_OUT_SLOTS, :bs],
                     extend_lens=[1] * bs, seq_lens=seq_lens,
                     seq_lens_device=staged[_SEQ_LENS, :bs])

    def _forward(self, batch: Batch) -> torch.Tensor:
        """What a graph runs: gather the input ids from the token pool, then the model."""
        bs = batch.size
        self.input_ids[:bs].copy_(self.token_pool[batch.rows, batch.positions])
        return self.model()

    def _capture(self, bs: int, pool: tuple) -> None:
        batch = self._static_batch(bs, [1] * bs)
        self.backend.prepare_for_capture(batch, self.page_table)
        for lora in (False, True) if self.lora_slots else (False,):
            batch.lora = self.lora_rows(bs) if lora else None
            with self.ctx.forward_batch(batch):
                self._forward(batch)  # warm-up: lazy initialization and kernel selection
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(batch)
            self.graphs[bs, lora] = graph
            self.logits[bs, lora] = logits

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [batch.size, vocab] of a decode batch made by `stage` (a view of the graph's
        output; the batch's input ids are filled in by the replay). A batch with `lora` set
        replays the LoRA graph (its block table was staged)."""
        assert batch.rows.data_ptr() == self.staged.data_ptr(), "the batch was not staged"
        n = batch.size
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        padded = self._static_batch(bs, list(batch.seq_lens) + [1] * (bs - n))
        self.backend.prepare_for_replay(padded, self.page_table)
        key = (bs, batch.lora is not None)
        self.graphs[key].replay()
        return self.logits[key][:n]
