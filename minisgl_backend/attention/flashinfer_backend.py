"""FlashInfer attention over the paged pool: paged prefill (with cached prefix) and decode.

The pool's per-layer K and V are `[pages + 1, page_size, kv_heads, head_dim]` ("NHD"), which
FlashInfer reads directly. Each step is planned once (`prepare`), then every layer runs the
planned kernels. Decode steps can replay CUDA graphs: one decode wrapper per captured batch
size, all sharing the same index buffers, re-planned in place before each replay.

FlashInfer fixes a sliding window (`window_left`) when it plans, so a step of a model with
sliding-window layers plans one more wrapper per window, the first time a layer of that window
runs in the step (a step of full-attention layers plans nothing more). A CUDA graph's windowed
wrappers are made in the warm-up before its capture and re-planned before every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.core import Batch
from minisgl_backend.device_copy import stack_to_device
from minisgl_backend.kvcache.pool import PagedKVPool

WORKSPACE_BYTES = 256 * 1024 * 1024


def paged_kv_layout(seq_lens: list[int], page_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request: pages used, the CSR indptr over them and the fill of the last page."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    pages = (lens + page_size - 1) // page_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    last_page_len = (lens - (pages - 1) * page_size).astype(np.int32)
    return pages, indptr, last_page_len


def gather_page_indices(page_table: torch.Tensor, rows: torch.Tensor, pages: np.ndarray,
                        indptr: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """The page ids of each request's first `pages[i]` pages, concatenated (no host sync)."""
    total = int(indptr[-1])
    device = page_table.device
    counts, starts = stack_to_device([pages, indptr[:-1]], device)
    row_of = torch.repeat_interleave(rows, counts, output_size=total)
    col = torch.arange(total, device=device) - torch.repeat_interleave(starts, counts,
                                                                       output_size=total)
    indices = page_table[row_of, col]
    if out is None:
        return indices
    out[:total].copy_(indices)
    return out[:total]


@dataclass
class FlashInferStep:
    """A step's planned wrapper (full attention), and its sliding-window wrappers: `wrapper_for`
    gets one per window, planned on first use with `plan(wrapper, window_left)`."""

    wrapper: Any
    new_wrapper: Callable[[int], Any]  # window -> the (reused) wrapper object for it
    plan: Callable[[Any, int], None]
    windowed: dict[int, Any] = field(default_factory=dict)

    def wrapper_for(self, window: int) -> Any:
        if not window:
            return self.wrapper
        if window not in self.windowed:
            wrapper = self.new_wrapper(window)
            self.plan(wrapper, window - 1)  # FlashInfer's window_left excludes the query
            self.windowed[window] = wrapper
        return self.windowed[window]


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool: PagedKVPool, num_heads: int, head_dim: int,
                 device: torch.device, max_pages_per_request: int,
                 prefill_backend: str = "auto") -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = kv_pool.buffer.shape[-2]
        self.head_dim = head_dim
        self.dtype = kv_pool.dtype  # q's and the output's
        self.kv_dtype = kv_pool.kv_dtype  # what the kernels read from the pool
        self.device = device
        self.max_pages_per_request = max_pages_per_request
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor-core decode pays off once several query heads share a KV head.
        self.decode_tensor_cores = num_heads // self.num_kv_heads >= 4
        self.prefill_backend = prefill_backend
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
        self.graph_wrappers: dict[int, object] = {}
        # Sliding-window wrappers, made once per (phase, window) and (graph size, window).
        self.window_wrappers: dict[tuple[str, int], Any] = {}
        self.graph_window_wrappers: dict[tuple[int, int], Any] = {}
        # plan() stages a wrapper's schedule in its pinned host memory and copies it to the
        # device asynchronously: its next plan must not overwrite it before that copy ran.
        self._plan_done: dict[int, torch.cuda.Event] = {}

    # ----- per step ---------------------------------------------------------------------------

    def prepare(self, batch: Batch, page_table: torch.Tensor) -> None:
        pages, indptr, last_page_len = paged_kv_layout(batch.seq_lens, self.kv_pool.page_size)
        indices = gather_page_indices(page_table, batch.rows, pages, indptr)
        if batch.is_decode:
            plan = partial(self._plan_decode, indptr, indices, last_page_len)
            wrapper, new_wrapper = self.decode_wrapper, self._new_decode_wrapper
        else:
            qo_indptr = np.zeros(batch.size + 1, dtype=np.int32)
            np.cumsum(batch.extend_lens, out=qo_indptr[1:])
            plan = partial(self._plan_prefill, qo_indptr, indptr, indices, last_page_len)
            wrapper, new_wrapper = self.prefill_wrapper, self._new_prefill_wrapper
        plan(wrapper, -1)
        batch.attn_metadata = FlashInferStep(wrapper, new_wrapper, plan)

    def _plan_decode(self, indptr: np.ndarray, indices: torch.Tensor, last_page_len: np.ndarray,
                     wrapper: Any, window_left: int) -> None:
        self._wait_previous_plan(wrapper)
        wrapper.plan(torch.from_numpy(indptr), indices, torch.from_numpy(last_page_len),
                     self.num_heads, self.num_kv_heads, self.head_dim, self.kv_pool.page_size,
                     window_left=window_left, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._record_plan(wrapper)

    def _plan_prefill(self, qo_indptr: np.ndarray, indptr: np.ndarray, indices: torch.Tensor,
                      last_page_len: np.ndarray, wrapper: Any, window_left: int) -> None:
        self._wait_previous_plan(wrapper)
        wrapper.plan(torch.from_numpy(qo_indptr), torch.from_numpy(indptr), indices,
                     torch.from_numpy(last_page_len), self.num_heads, self.num_kv_heads,
                     self.head_dim, self.kv_pool.page_size, causal=True,
                     window_left=window_left, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._record_plan(wrapper)

    def _new_decode_wrapper(self, window: int) -> Any:
        return _cached(self.window_wrappers, ("decode", window), lambda: (
            self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)))

    def _new_prefill_wrapper(self, window: int) -> Any:
        return _cached(self.window_wrappers, ("prefill", window), lambda: (
            self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend)))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, batch: Batch, window: int = 0) -> torch.Tensor:
        if k is not None:
            self.kv_pool.store(layer_id, batch.out_slots, k, v)
        pool = self.kv_pool
        kv = (pool.buffer[0, layer_id], pool.buffer[1, layer_id])
        # FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale:
        # the dequantized attention, in another order.
        scales = {"k_scale": pool.k_scale(layer_id), "v_scale": pool.v_scale(layer_id)} \
            if pool.quantized else {}
        step: FlashInferStep = batch.attn_metadata
        out = step.wrapper_for(window).run(q.contiguous(), kv, **scales)
        return out.reshape(q.shape[0], -1)

    def _wait_previous_plan(self, wrapper: Any) -> None:
        if id(wrapper) in self._plan_done:
            self._plan_done[id(wrapper)].synchronize()

    def _record_plan(self, wrapper: Any) -> None:
        self._plan_done.setdefault(id(wrapper), torch.cuda.Event()).record()

    # ----- CUDA graphs (decode) ---------------------------------------------------------------

    def init_cuda_graph(self, max_bs: int) -> None:
        dev = self.device
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.graph_indices = torch.zeros(max_bs * self.max_pages_per_request, dtype=torch.int32,
                                         device=dev)
        self.graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)

    def prepare_for_capture(self, batch: Batch, page_table: torch.Tensor) -> None:
        bs = batch.size
        self.graph_wrappers[bs] = self._new_graph_wrapper(bs)
        self._plan_graph(batch, None)

    def prepare_for_replay(self, batch: Batch, page_table: torch.Tensor) -> None:
        self._plan_graph(batch, page_table)

    def _new_graph_wrapper(self, bs: int) -> Any:
        """A decode wrapper for graphs of `bs` rows; all share the index buffers (their
        contents are the same for every window)."""
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=self.graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self.graph_indices,
            paged_kv_last_page_len_buffer=self.graph_last_page_len[:bs])

    def _plan_graph(self, batch: Batch, page_table: torch.Tensor | None) -> None:
        """Plan the graph's wrappers for `batch`: the full-attention one and (at replay) those
        of the windows its capture used."""
        bs = batch.size
        pages, indptr, last_page_len = paged_kv_layout(batch.seq_lens, self.kv_pool.page_size)
        if page_table is None:  # capture: every row is the dummy row, one dummy page each
            indices = torch.full((int(indptr[-1]),), self.kv_pool.dummy_page, dtype=torch.int32,
                                 device=self.device)
        else:
            indices = gather_page_indices(page_table, batch.rows, pages, indptr)
        plan = partial(self._plan_decode, indptr, indices, last_page_len)
        step = FlashInferStep(self.graph_wrappers[bs], lambda window: _cached(
            self.graph_window_wrappers, (bs, window), lambda: self._new_graph_wrapper(bs)), plan)
        plan(step.wrapper, -1)
        if page_table is not None:  # replay: the captured kernels read every windowed plan
            for (size, window), wrapper in self.graph_window_wrappers.items():
                if size == bs:
                    plan(wrapper, window - 1)
                    step.windowed[window] = wrapper
        batch.attn_metadata = step


def _cached(cache: dict, key: Any, make: Callable[[], Any]) -> Any:
    if key not in cache:
        cache[key] = make()
    return cache[key]
