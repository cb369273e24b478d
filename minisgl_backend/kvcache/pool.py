"""The paged KV pool: one tensor holding every layer's K and V for every page."""

from __future__ import annotations

from typing import Sequence

import torch

from minisgl_backend.quantization.fp8 import FP8, saturate

# `kv_cache_dtype` setting -> storage dtype ("auto": the model's own).
KV_CACHE_DTYPES = {"fp8": FP8, "fp8_e4m3": FP8}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for the `kv_cache_dtype` setting `name`."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return KV_CACHE_DTYPES[name]


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K or V read from the pool in the compute `dtype`: FP8 values times their layer's
    scale (in float32, then rounded once); values of any other dtype as they are."""
    if stored.dtype != FP8:
        return stored
    return (stored.float() * scale).to(dtype)


class PagedKVPool:
    """`[2, layers, pages + 1, page_size, kv_heads_per_rank, head_dim]`; K is 0, V is 1.

    The extra last page is the dummy page: padded (dummy) requests write there, harmlessly.

    `dtype` is the model's (what attention computes in); `kv_dtype` what the pool stores, by
    default the same. An FP8 pool (`quantized`) stores each layer's K as
    `saturate(k, k_scales[layer])` (V likewise) and readers take back `stored * scale`
    (`k_scale(layer)`, `v_scale(layer)`); every other pool stores values as they are (scale 1).
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
        kv_dtype: torch.dtype | None = None,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dummy_page = num_pages
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self._k_scales = _layer_scales(k_scales, num_layers, self.quantized)
        self._v_scales = _layer_scales(v_scales, num_layers, self.quantized)
        shape = (2, num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        # Left uninitialized (on CPU the pages are only touched when used); the dummy page is
        # zeroed because attention reads it as padding.
        self.buffer = torch.empty(shape, dtype=self.kv_dtype, device=device)
        self.buffer[:, :, self.dummy_page].zero_()
        # Flat views [slots, kv_heads, head_dim] per layer, slot = page * page_size + offset.
        self._k = [self.buffer[0, i].view(-1, num_kv_heads, head_dim) for i in range(num_layers)]
        self._v = [self.buffer[1, i].view(-1, num_kv_heads, head_dim) for i in range(num_layers)]

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == FP8

    @property
    def dummy_slot(self) -> int:
        return self.dummy_page * self.page_size

    @property
    def capacity(self) -> int:
        """Tokens the pool holds (the dummy page aside)."""
        return self.num_pages * self.page_size

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._k[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    def k_scale(self, layer_id: int) -> float:
        """What layer `layer_id`'s stored K is multiplied by when read (1.0 unless FP8)."""
        return self._k_scales[layer_id]

    def v_scale(self, layer_id: int) -> float:
        return self._v_scales[layer_id]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new K/V [tokens, kv_heads, head_dim] into their slots."""
        if self.quantized:
            k = saturate(k, self._k_scales[layer_id])
            v = saturate(v, self._v_scales[layer_id])
        self._k[layer_id][slots] = k
        self._v[layer_id][slots] = v

    def gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (any shape; results [*slots.shape, kv_heads, head_dim]) as
        attention reads them: dequantized to `dtype` from an FP8 pool, else as stored."""
        return (dequantize_kv(self._k[layer_id][slots], self._k_scales[layer_id], dtype),
                dequantize_kv(self._v[layer_id][slots], self._v_scales[layer_id], dtype))

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one page of every layer's K and V stored in `dtype` (the storage dtype)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


def _layer_scales(scales: Sequence[float] | None, num_layers: int,
                  quantized: bool) -> list[float]:
    """One float per layer: the given ones for an FP8 pool, else 1.0 (nothing is scaled)."""
    if not quantized or scales is None:
        return [1.0] * num_layers
    if len(scales) != num_layers:
        raise ValueError(f"{len(scales)} KV scales for {num_layers} layers")
    if not all(s > 0 for s in scales):
        raise ValueError(f"KV scales must be positive, got {list(scales)}")
    return [float(s) for s in scales]
