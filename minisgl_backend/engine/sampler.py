"""Batched, seeded token sampling (greedy, temperature, top-k, top-p).

Randomness comes from a counter-based hash of (seed, position) rather than from a torch
generator, so a request's samples depend only on its own seed and token positions: the same
seed gives the same output regardless of batch composition, device, process or
tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl_backend.core import RowSampling
from minisgl_backend.device_copy import host_to_device, stack_to_device
from minisgl_backend.layers.fast_ops import use_triton_kernels

if TYPE_CHECKING:  # Triton's kernels are imported where a GPU runs them
    from kernels.sampling import MinPFloor

_MASK32 = 0xFFFFFFFF
_UINT64_MASK = (1 << 64) - 1


def uses_kernels(logits: torch.Tensor) -> bool:
    """The one choice between the Triton kernels (`kernels/`) and the torch references for a
    step's logits: the kernels where they run compiled (a GPU), on logits with unit stride
    along the vocabulary."""
    return use_triton_kernels(logits) and logits.stride(1) == 1


@dataclass
class SamplingTensors:
    """A batch's sampling parameters on the device (`of`, made once per batch), and one step's
    positions (`at`). The rows' rules come decided (`core.RowSampling`)."""

    temperature: torch.Tensor  # [bs] float64; 0: a greedy row
    top_k: torch.Tensor  # [bs] int64; <= 0 or >= vocab: off
    top_p: torch.Tensor  # [bs] float64 in (0, 1]
    seed: torch.Tensor  # [bs] int64 (a 64-bit unsigned seed stored as its int64 bit pattern)
    filtered: torch.Tensor  # [bs] bool: top-k / top-p removes tokens of the row
    host_seeds: np.ndarray  # [bs] int64: the torch path draws its uniforms on the host
    all_greedy: bool  # fast path: every row greedy -> pure argmax, no randomness
    any_filtered: bool  # some row takes the sorted path (False skips the vocab sort)
    position: torch.Tensor | None = None  # [bs] int64: the sampled token's index in its row
    # seeded_uniform(seed, position), computed on the host for the torch path: one upload
    # instead of ~40 small kernels per step (the kernels compute it themselves).
    uniform: torch.Tensor | None = None  # [bs] float64
    # min_p's floor, left by the edit kernels (`LogitControls.apply`): applied by `sample`.
    min_p: MinPFloor | None = None

    @classmethod
    def of(cls, params: RowSampling, rows: np.ndarray,
           device: torch.device | str) -> SamplingTensors:
        """Table rows `rows` of `params` (host arrays, floats in float64) in one upload: the
        float64 values travel as their bits."""
        seeds, filtered = params.seed[rows], params.filtered[rows]
        top_k, seed, temperature, top_p, filtered_t = stack_to_device(
            [params.top_k[rows], seeds, params.temperature[rows].view(np.int64),
             params.top_p[rows].view(np.int64), filtered], torch.device(device))
        return cls(temperature.view(torch.float64), top_k, top_p.view(torch.float64), seed,
                   filtered_t.bool(), seeds, bool(params.greedy[rows].all()),
                   bool(filtered.any()))

    def at(self, logits: torch.Tensor, position: torch.Tensor, host_position: np.ndarray,
           min_p: MinPFloor | None = None) -> SamplingTensors:
        """These parameters for one step of `logits`: the sampled tokens' positions (on the
        device and on the host) and min_p's floor where the edit kernels left it."""
        uniform = None
        if not self.in_kernel(logits):
            uniform = host_to_device(seeded_uniform_host(self.host_seeds, host_position),
                                     logits.device)
        return dataclasses.replace(self, position=position, uniform=uniform, min_p=min_p)

    def in_kernel(self, logits: torch.Tensor) -> bool:
        """`sample` takes the Triton kernels (`kernels.sampling`), which draw each row's
        uniform number themselves: without top-k / top-p rows (the sorted path is torch's)."""
        return not self.any_filtered and uses_kernels(logits)


def seed_to_int64(seed: int) -> int:
    """Return the int64 bit pattern of a 64-bit unsigned seed (taken mod 2**64)."""
    seed &= _UINT64_MASK
    return seed - (1 << 64) if seed >= (1 << 63) else seed


# The hash below runs unchanged on int64 torch tensors and int64 numpy arrays (same operators,
# same arithmetic shifts), so host and device give the same bits.
IntArray = torch.Tensor | np.ndarray


def _mul32(x: IntArray, m: int) -> IntArray:
    """(x * m) mod 2**32 for int64 values x in [0, 2**32), without int64 overflow."""
    # A multiplier >= 2**31 is replaced by m - 2**32 (same residue mod 2**32), so that
    # |x * m| < 2**32 * 2**31 = 2**63 always; masking a negative int64 keeps the right residue.
    if m >= 1 << 31:
        m -= 1 << 32
    return (x * m) & _MASK32


def _mix32(x: IntArray) -> IntArray:
    """Bijective 32-bit integer hash (MurmurHash3 fmix32) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def seeded_uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One float64 uniform number in (0, 1) per row, a pure function of (seed, position)
    (int64 bit patterns); exact integer ops only, so every device gives the same bits."""
    h = _hash32(seed.to(torch.int64), position.to(device=seed.device, dtype=torch.int64))
    return (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)


def seeded_uniform_host(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """`seeded_uniform` on the host (numpy), bit for bit."""
    h = _hash32(seed.astype(np.int64), position.astype(np.int64))
    return (h.astype(np.float64) + 0.5) * (1.0 / 4294967296.0)


def _hash32(seed: IntArray, position: IntArray) -> IntArray:
    # The arithmetic shift of negative values is fine: only the masked low 32 bits are used.
    h = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    h = _mix32(h ^ (position & _MASK32))
    return _mix32(h ^ ((position >> 32) & _MASK32))


def _sample_unsorted(scaled_logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in token-id order: exact sampling without sorting the vocabulary."""
    probs = torch.softmax(scaled_logits, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniform * cdf[:, -1].to(torch.float64)).to(torch.float32)
    ids = torch.searchsorted(cdf, target.unsqueeze(1).contiguous(), right=True).squeeze(1)
    return ids.clamp_(max=scaled_logits.shape[1] - 1)


def _sample_sorted(sorted_logits: torch.Tensor, params: SamplingTensors,
                   uniform: torch.Tensor) -> torch.Tensor:
    """Pick a rank into each row of descending-sorted scaled logits; returns [bs, 1] int64."""
    bs, vocab = sorted_logits.shape
    device = sorted_logits.device
    probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)

    # Top-k: keep the k largest logits, then renormalize.
    top_k = params.top_k.to(device)
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    probs = torch.where(ranks < k.unsqueeze(1), probs, torch.zeros_like(probs))
    probs = probs / probs.sum(dim=-1, keepdim=True)

    # Top-p: keep a token iff the mass strictly before it is < top_p (the rank-0 token
    # always has zero mass before it, so it is always kept).
    top_p = params.top_p.to(device=device, dtype=torch.float32).unsqueeze(1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where(mass_before < top_p, probs, torch.zeros_like(probs))
    num_kept = (probs > 0).sum(dim=-1, keepdim=True).clamp_min(1)

    # Inverse CDF over the (unnormalized) kept mass with one uniform per row.
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniform.unsqueeze(1) * cdf[:, -1:].to(torch.float64)).to(torch.float32)
    rank = torch.searchsorted(cdf, target.contiguous(), right=True)
    # Rounding can put the target at or past the total mass: clamp into the kept set.
    return torch.minimum(rank, num_kept - 1)


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """One token id per row of `logits` [bs, vocab], [bs] int64: the argmax for greedy rows
    (temperature 0), else softmax(logits / temperature) cut to top-k then top-p, drawn with
    `seeded_uniform(seed, position)`. On a GPU, batches without top-k / top-p take the Triton
    kernels (`kernels.sampling`)."""
    if params.all_greedy:
        return greedy(logits, params.min_p)
    if params.in_kernel(logits):
        from kernels.sampling import sample_from_logits

        if params.uniform is not None:
            return sample_from_logits(logits, params.temperature, params.uniform,
                                      min_p=params.min_p)
        return sample_from_logits(logits, params.temperature, seed=params.seed,
                                  position=params.position, min_p=params.min_p)
    _apply_floor(logits, params.min_p)
    device = logits.device
    uniform = params.uniform
    if uniform is None:
        assert params.position is not None
        uniform = seeded_uniform(params.seed.to(device), params.position.to(device))
    return sample_with_torch(logits.float(), params, uniform.to(device))


def greedy(logits: torch.Tensor, min_p: MinPFloor | None = None) -> torch.Tensor:
    """Each row's first largest logit (after min_p's floor, if the edits left it)."""
    _apply_floor(logits, min_p)
    return torch.argmax(logits, dim=-1)  # the same index in any precision of the logits


def _apply_floor(logits: torch.Tensor, min_p: MinPFloor | None) -> None:
    """Write min_p's floor into `logits` (in place), for the paths that read them as they are."""
    if min_p is not None:
        from kernels.sampling import apply_min_p_floor

        apply_min_p_floor(logits, min_p)


def sample_with_torch(logits: torch.Tensor, params: SamplingTensors,
                      uniform: torch.Tensor) -> torch.Tensor:
    """`sample`'s torch path (every device; the reference): float32 `logits`, the rows'
    seeded uniforms on their device."""
    device = logits.device
    greedy_ids = torch.argmax(logits, dim=-1)
    temperature = params.temperature.to(device=device, dtype=torch.float32)
    greedy = temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temperature.unsqueeze(1)
    sampled_ids = _sample_unsorted(scaled, uniform)
    if params.any_filtered:
        # Stable sort: ties are ordered by token id, so the result never depends on the kernel.
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
        rank = _sample_sorted(sorted_logits, params, uniform)
        filtered_ids = torch.gather(sorted_ids, 1, rank).squeeze(1)
        sampled_ids = torch.where(params.filtered.to(device), filtered_ids, sampled_ids)
    return torch.where(greedy, greedy_ids, sampled_ids)
