"""The paged KV pool: one tensor holding every layer's K and V for every page."""

from __future__ import annotations

import torch


class PagedKVPool:
    """`[2, layers, pages + 1, page_size, kv_heads_per_rank, head_dim]`; K is 0, V is 1.

    The extra last page is the dummy page: padded (dummy) requests write there, harmlessly.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dummy_page = num_pages
        shape = (2, num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        # Left uninitialized (on CPU the pages are only touched when used); the dummy page is
        # zeroed because attention reads it as padding.
        self.buffer = torch.empty(shape, dtype=dtype, device=device)
        self.buffer[:, :, self.dummy_page].zero_()
        # Flat views [slots, kv_heads, head_dim] per layer, slot = page * page_size + offset.
        self._k = [self.buffer[0, i].view(-1, num_kv_heads, head_dim) for i in range(num_layers)]
        self._v = [self.buffer[1, i].view(-1, num_kv_heads, head_dim) for i in range(num_layers)]

    @property
    def dummy_slot(self) -> int:
        return self.dummy_page * self.page_size

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._k[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new K/V [tokens, kv_heads, head_dim] into their slots."""
        self._k[layer_id][slots] = k
        self._v[layer_id][slots] = v

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize
