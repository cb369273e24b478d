"""Rotary position embedding (default, linear, llama3 and LongRoPE frequencies), in HF's
arithmetic; on a GPU in half precision, FlashInfer's in-place kernel over a cos/sin table.

LongRoPE (Phi-3) has two sets of frequencies: HF picks the long set for a forward whose
sequence runs past the pretraining length, the short one otherwise, and its generate computes a
sequence whole again when it crosses that length. Here each request's KV is computed with one
set, which the scheduler chooses (`Req.long_rope`: the long one for a prompt past the length,
and from a crossing on, which the scheduler computes whole again); its tokens then look up the
second half of the cos/sin table.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from minisgl_backend.core import Batch
from minisgl_backend.device_copy import host_to_device
from minisgl_backend.layers.fast_ops import flashinfer_module, use_flashinfer
from minisgl_backend.models.config import RopeConfig


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (on cpu, float32, even inside a meta-device scope);
    LongRoPE's short set."""
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(head_dim, rope, "short_factor")
    inv_freq = 1.0 / (rope.theta ** _exponents(head_dim))
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope.scaling)
    elif rope.rope_type == "linear":
        inv_freq = inv_freq / rope.scaling["factor"]
    return inv_freq


def _longrope_inv_freq(head_dim: int, rope: RopeConfig, which: str) -> torch.Tensor:
    factors = torch.tensor(rope.scaling[which], dtype=torch.float32, device="cpu")
    return 1.0 / (factors * rope.theta ** _exponents(head_dim))


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
    """Rotary position embedding ("rotate half", as HF Llama/Qwen) for q and k.

    `long_inv_freq`: LongRoPE's long set, used by requests longer than `long_from` tokens;
    `scaling` multiplies cos and sin (LongRoPE's attention factor).
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, *,
                 long_inv_freq: torch.Tensor | None = None, long_from: int = 0,
                 scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq  # [head_dim // 2] float32
        self.long_inv_freq = long_inv_freq
        self.long_from = long_from
        self.scaling = scaling
        self.max_positions = max_positions
        self._cos_sin_cache: torch.Tensor | None = None

    @classmethod
    def for_config(cls, head_dim: int, rope: RopeConfig, max_positions: int) -> RotaryEmbedding:
        if rope.rope_type != "longrope":
            return cls(rope_inv_freq(head_dim, rope), max_positions)
        return cls(rope_inv_freq(head_dim, rope), max_positions,
                   long_inv_freq=_longrope_inv_freq(head_dim, rope, "long_factor"),
                   long_from=rope.long_from,
                   scaling=rope.scaling["attention_factor"])

    def to(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)
        self._cos_sin_cache = None

    def cos_sin_cache(self) -> torch.Tensor:
        """[table rows, head_dim] float32: cos of every frequency, then sin (FlashInfer's);
        one row per position, then (LongRoPE) one per position with the long frequencies."""
        if self._cos_sin_cache is None:
            positions = torch.arange(self.max_positions, device=self.inv_freq.device).float()
            sets = [self.inv_freq] if self.long_inv_freq is None else \
                [self.inv_freq, self.long_inv_freq]
            freqs = torch.cat([positions[:, None] * inv[None, :] for inv in sets])
            self._cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.scaling
        return self._cos_sin_cache

    def table_rows(self, batch: Batch) -> torch.Tensor:
        """Each token's row of the cos/sin table: its position, plus max_positions where its
        request's KV takes LongRoPE's long frequencies (the positions themselves otherwise)."""
        if self.long_inv_freq is None:
            return batch.positions
        if batch.long_rope is None:
            # A decode token: a request computing a position past the pretraining length is
            # in the long set (the scheduler recomputes a request that crosses it first).
            long = batch.positions >= self.long_from
        else:
            flags = np.repeat(batch.long_rope, batch.extend_lens)
            long = host_to_device(flags, batch.positions.device)
        return batch.positions + long.to(batch.positions.dtype) * self.max_positions

    def apply(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, dim] and k [tokens, kv_heads, dim], rotated (maybe in place);
        `rows` from `table_rows` (the positions, without LongRoPE)."""
        head_dim = q.shape[-1]
        if use_flashinfer(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            flashinfer_module().rope.apply_rope_with_cos_sin_cache_inplace(
                rows, q.view(q.shape[0], -1), k.view(k.shape[0], -1), head_dim,
                self.cos_sin_cache(), is_neox=True)
            return q, k
        cos, sin = self._cos_sin(rows, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _cos_sin(self, rows: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim], computed in float32 then cast (HF's arithmetic)."""
        inv_freq = self.inv_freq[None, :]
        positions = rows
        if self.long_inv_freq is not None:
            long = rows >= self.max_positions
            inv_freq = torch.where(long[:, None], self.long_inv_freq[None, :], inv_freq)
            positions = rows - long.to(rows.dtype) * self.max_positions
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
