"""The reference attention backend: plain torch over the paged pool, on CPU or GPU.

It is the correctness oracle the fast GPU backends are tested against, so it favours clarity:
prefill attends request by request; decode gathers a padded [batch, max_len] block at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.core import Batch
from minisgl_backend.kvcache.pool import PagedKVPool

IntArray = TypeVar("IntArray", torch.Tensor, np.ndarray)


@dataclass
class TorchAttnMetadata:
    kv_slots: torch.Tensor  # [bs, max_seq_len] slot of every token (padding: the dummy slot)
    kv_mask: torch.Tensor  # [bs, 1, q_len or 1, max_seq_len] True where a query may attend
    q_pos: torch.Tensor  # [bs, q_len or 1] position of every query
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int) -> torch.Tensor:
        """kv_mask, limited to each query's last `window` keys (0: no limit); built once per
        window and step."""
        if not window:
            return self.kv_mask
        if window not in self._window_masks:
            kv_pos = torch.arange(self.kv_mask.shape[-1], device=self.kv_mask.device)
            inside = kv_pos[None, None, None, :] > self.q_pos[:, None, :, None] - window
            self._window_masks[window] = self.kv_mask & inside
        return self._window_masks[window]


def token_slots(page_table: IntArray, rows: IntArray, positions: IntArray,
                page_size: int) -> IntArray:
    """Flat pool slot of each (row, position) pair: on the device (torch tensors) or, from the
    engine's host copy of its page table, on the host (numpy arrays). `positions` is int64."""
    pages = page_table[rows, positions // page_size]
    pages = pages.astype(np.int64) if isinstance(pages, np.ndarray) else pages.long()
    return pages * page_size + positions % page_size


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: PagedKVPool, num_heads: int, head_dim: int) -> None:
        self.kv_pool = kv_pool
        self.scale = head_dim**-0.5

    def prepare(self, batch: Batch, page_table: torch.Tensor) -> None:
        device = batch.input_ids.device
        max_len = max(batch.seq_lens)
        pos = torch.arange(max_len, device=device)
        seq_lens = torch.tensor(batch.seq_lens, device=device)
        valid = pos[None, :] < seq_lens[:, None]  # [bs, max_len]
        rows = batch.rows[:, None].expand(-1, max_len)
        slots = token_slots(page_table, rows, pos[None, :].clamp(max=max_len - 1).expand_as(rows),
                            self.kv_pool.page_size)
        slots = slots.masked_fill(~valid, self.kv_pool.dummy_slot)
        if batch.is_decode:
            mask = valid[:, None, None, :]
            q_pos = (seq_lens - 1)[:, None]
        else:
            max_q = max(batch.extend_lens)
            q_pos = (seq_lens - torch.tensor(batch.extend_lens, device=device))[:, None] + \
                torch.arange(max_q, device=device)[None, :]  # [bs, max_q]
            mask = (pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
            mask = mask[:, None]  # [bs, 1, max_q, max_len]
        batch.attn_metadata = TorchAttnMetadata(kv_slots=slots, kv_mask=mask, q_pos=q_pos)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, batch: Batch, window: int = 0) -> torch.Tensor:
        if k is not None:
            self.kv_pool.store(layer_id, batch.out_slots, k, v)
        meta: TorchAttnMetadata = batch.attn_metadata
        kv_mask = meta.mask(window)
        # [bs, max_len, kv_heads, dim]; the step's own K/V too come back as stored (rounded
        # to FP8 in an FP8 pool), as later steps will read them.
        k_all, v_all = self.kv_pool.gather(layer_id, meta.kv_slots, q.dtype)
        if batch.is_decode:
            out = self._attend(q[:, None], k_all, v_all, kv_mask)  # [bs, 1, heads, dim]
            return out.reshape(q.shape[0], -1)
        outputs = []
        start = 0
        for i, n in enumerate(batch.extend_lens):
            length = batch.seq_lens[i]
            mask = kv_mask[i : i + 1, :, :n, :length]
            o = self._attend(q[None, start : start + n], k_all[i : i + 1, :length],
                             v_all[i : i + 1, :length], mask)
            outputs.append(o[0])
            start += n
        return torch.cat(outputs).reshape(q.shape[0], -1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """q [b, n, heads, d], k/v [b, L, kv_heads, d], mask [b, 1, n, L] -> [b, n, heads, d]
        (`enable_gqa` shares each KV head with its query heads without copying K/V)."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            scale=self.scale, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
