"""Attention with the engine's own Triton kernels (`kernels/`): paged, GQA, CUDA-graph ready.

Each step `prepare` uploads a few int32 vectors (lengths, query offsets); each layer's forward
stores this step's K/V with one kernel, then runs the split-KV decode kernels or the causal
extend kernel, all reading K/V through the engine's page table.

Without a GPU the kernels run through Triton's interpreter (slow; for tests), which the `kernels`
package selects when it is first imported in a process where torch sees no CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from kernels import is_interpreted
from kernels.decode_attention import (DecodeLaunch, DecodeWorkspace, decode_attention,
                                      decode_num_splits, decode_workspace)
from kernels.extend_attention import extend_attention
from kernels.kv_store import _kv_store_kernel, store_kv
from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.core import Batch
from minisgl_backend.device_copy import host_to_device, stack_to_device
from minisgl_backend.kvcache.pool import PagedKVPool

DEFAULT_MAX_SPLITS = 16


@dataclass
class TritonAttnMetadata:
    page_table: torch.Tensor  # the engine's [rows, max_pages] int32 table
    rows: torch.Tensor  # [bs] int64 table row of each request
    seq_lens: torch.Tensor  # [bs] int32 tokens per request including this step's
    # Prefill only: where each request's new tokens start in q, and how many there are.
    q_starts: torch.Tensor | None = None  # [bs] int32
    extend_lens: torch.Tensor | None = None  # [bs] int32
    max_extend_len: int = 0
    # Decode only: KV splits per request and the fp32 scratch of the partial results.
    num_splits: int = 1
    workspace: DecodeWorkspace | None = None


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool: PagedKVPool, num_heads: int, head_dim: int,
                 max_splits: int = DEFAULT_MAX_SPLITS,
                 decode_launch: DecodeLaunch | None = None) -> None:
        device = kv_pool.buffer.device
        if device.type != "cuda" and not is_interpreted(_kv_store_kernel):
            raise RuntimeError("the triton attention backend runs on CPU only through Triton's "
                               "interpreter: set TRITON_INTERPRET=1 before the kernels are "
                               "imported (the default where torch sees no CUDA)")
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = kv_pool.buffer.shape[4]
        assert num_heads % self.num_kv_heads == 0, \
            f"{num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads"
        self.max_splits = max_splits
        self.decode_launch = decode_launch  # None: the kernel's defaults
        self.scale = head_dim**-0.5
        self.device = device
        self._graph: _GraphBuffers | None = None

    def num_splits(self, batch_size: int) -> int:
        return decode_num_splits(batch_size, self.num_kv_heads, self.max_splits)

    # -- eager steps ------------------------------------------------------------------------
    def prepare(self, batch: Batch, page_table: torch.Tensor) -> None:
        bs = batch.size
        if batch.is_decode:
            seq_lens = batch.seq_lens_device
            if seq_lens is None:
                seq_lens = host_to_device(batch.seq_lens, self.device, torch.int32)
            splits = self.num_splits(bs)
            batch.attn_metadata = TritonAttnMetadata(
                page_table=page_table, rows=batch.rows, seq_lens=seq_lens, num_splits=splits,
                workspace=decode_workspace(bs, self.num_heads, self.head_dim, splits,
                                           self.device))
            return
        starts = [0, *accumulate(batch.extend_lens)][:-1]
        seq_lens, q_starts, extend_lens = stack_to_device(
            [batch.seq_lens, starts, batch.extend_lens], self.device, torch.int32)
        batch.attn_metadata = TritonAttnMetadata(
            page_table=page_table, rows=batch.rows, seq_lens=seq_lens, q_starts=q_starts,
            extend_lens=extend_lens, max_extend_len=max(batch.extend_lens))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, batch: Batch, window: int = 0) -> torch.Tensor:
        pool = self.kv_pool
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        scales = {"k_scale": pool.k_scale(layer_id), "v_scale": pool.v_scale(layer_id)}
        if k is not None:
            store_kv(k, v, k_cache, v_cache, batch.out_slots, **scales)
        meta: TritonAttnMetadata = batch.attn_metadata
        page_size = self.kv_pool.page_size
        if batch.is_decode:
            out = decode_attention(q, k_cache, v_cache, meta.page_table, meta.rows, meta.seq_lens,
                                   page_size=page_size, sm_scale=self.scale,
                                   num_splits=meta.num_splits, workspace=meta.workspace,
                                   launch=self.decode_launch, window=window, **scales)
        else:
            assert meta.q_starts is not None and meta.extend_lens is not None
            out = extend_attention(q, k_cache, v_cache, meta.page_table, meta.rows, meta.seq_lens,
                                   meta.q_starts, meta.extend_lens,
                                   max_extend_len=meta.max_extend_len, page_size=page_size,
                                   sm_scale=self.scale, window=window, **scales)
        return out.view(q.shape[0], -1)

    # -- CUDA graphs (decode) ---------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int) -> None:
        self._graph = _GraphBuffers.allocate(self, max_bs)

    def prepare_for_capture(self, batch: Batch, page_table: torch.Tensor) -> None:
        """Point `batch.attn_metadata` at views of the static buffers for batch.size requests.

        The captured kernels read the page table by address, so it must be the engine's one
        table for every captured size."""
        graph = self._graph
        assert graph is not None, "call init_cuda_graph(max_bs) first"
        assert batch.is_decode, "only decode steps are captured"
        if graph.page_table is not None and not _same_tensor(graph.page_table, page_table):
            raise RuntimeError("all CUDA graphs must be captured with the same page table")
        graph.page_table = page_table
        bs = batch.size
        assert bs <= graph.max_bs, f"batch of {bs} > init_cuda_graph's max_bs {graph.max_bs}"
        if batch.seq_lens_device is not None:
            # The graph runner's own static rows and lengths, which it fills before every
            # replay: the kernels read them in place.
            rows, seq_lens = batch.rows, batch.seq_lens_device
            graph.adopted = (rows.data_ptr(), seq_lens.data_ptr())
        else:
            graph.fill(batch, page_table.shape[0] - 1)
            rows, seq_lens = graph.rows[:bs], graph.seq_lens[:bs]
        batch.attn_metadata = TritonAttnMetadata(
            page_table=page_table, rows=rows, seq_lens=seq_lens,
            num_splits=self.num_splits(bs), workspace=graph.workspace)

    def prepare_for_replay(self, batch: Batch, page_table: torch.Tensor) -> None:
        """Copy this step's rows and lengths into the static buffers, on the device only (no
        host copy that could wait for the GPU). `batch` is the real batch or one padded to the
        graph's size; entries past batch.size get the dummy row and length 0 (output zeros).
        Nothing to copy where the capture adopted the batch's own rows and lengths."""
        graph = self._graph
        assert graph is not None and graph.page_table is not None, "no CUDA graph was captured"
        if not _same_tensor(page_table, graph.page_table):
            raise RuntimeError("replay with another page table than the graphs were captured with")
        if graph.adopted is None:
            graph.fill(batch, page_table.shape[0] - 1)
        elif batch.seq_lens_device is None or graph.adopted != (
                batch.rows.data_ptr(), batch.seq_lens_device.data_ptr()):
            raise RuntimeError("the graphs read the graph runner's static rows and lengths: "
                               "replay with them")


@dataclass
class _GraphBuffers:
    """Static decode metadata shared by the graphs of every batch size (each uses a prefix)."""

    max_bs: int
    rows: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    workspace: DecodeWorkspace
    page_table: torch.Tensor | None = None
    # Set where the captured batch brought its own device lengths (`Batch.seq_lens_device`):
    # the addresses of its rows and lengths, which the graphs then read instead of these.
    adopted: tuple[int, int] | None = None

    @staticmethod
    def allocate(backend: TritonAttentionBackend, max_bs: int) -> _GraphBuffers:
        dev = backend.device
        # Sized for the largest bs * num_splits(bs) any batch size up to max_bs needs.
        most = max(bs * backend.num_splits(bs) for bs in range(1, max_bs + 1))
        return _GraphBuffers(max_bs, torch.zeros(max_bs, dtype=torch.int64, device=dev),
                             torch.zeros(max_bs, dtype=torch.int32, device=dev),
                             decode_workspace(most, backend.num_heads, backend.head_dim, 1, dev))

    def fill(self, batch: Batch, dummy_row: int) -> None:
        bs = batch.size
        assert bs <= self.max_bs, f"batch of {bs} > init_cuda_graph's max_bs {self.max_bs}"
        self.rows[:bs].copy_(batch.rows)
        self.rows[bs:].fill_(dummy_row)
        # A decode query sits at position seq_len - 1, so the lengths come from the positions
        # already on the device.
        self.seq_lens[:bs].copy_(batch.positions)
        self.seq_lens[:bs].add_(1)
        self.seq_lens[bs:].zero_()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
