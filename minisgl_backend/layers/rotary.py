"""Rotary position embedding (default and llama3 frequency scaling), in HF's arithmetic; on a
GPU in half precision, FlashInfer's in-place kernel over a cos/sin table."""

from __future__ import annotations

import math

import torch

from minisgl_backend.layers.fast_ops import flashinfer_module, use_flashinfer
from minisgl_backend.models.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (on cpu, float32, even inside a meta-device scope)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope.scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotary position embedding ("rotate half", as HF Llama/Qwen) for q and k."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        self.inv_freq = inv_freq  # [head_dim // 2] float32
        self.max_positions = max_positions
        self._cos_sin_cache: torch.Tensor | None = None

    def to(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)
        self._cos_sin_cache = None

    def cos_sin_cache(self) -> torch.Tensor:
        """[max_positions, head_dim] float32: cos of every frequency, then sin (FlashInfer's)."""
        if self._cos_sin_cache is None:
            positions = torch.arange(self.max_positions, device=self.inv_freq.device).float()
            freqs = positions[:, None] * self.inv_freq[None, :]
            self._cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return self._cos_sin_cache

    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, dim] and k [tokens, kv_heads, dim], rotated (maybe in place)."""
        head_dim = q.shape[-1]
        if use_flashinfer(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            flashinfer_module().rope.apply_rope_with_cos_sin_cache_inplace(
                positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1), head_dim,
                self.cos_sin_cache(), is_neox=True)
            return q, k
        cos, sin = _cos_sin(positions, self.inv_freq, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, 1, head_dim], computed in float32 then cast (HF's arithmetic)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
