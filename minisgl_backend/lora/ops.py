"""The LoRA delta of a batch whose rows take different adapters (or none).

A step's tokens are grouped by adapter slot once (`LoraRows`, built by the engine); each adapted
projection then adds, group by group, `(x[g] @ A[slot].T) @ B[slot].T` to its output: the
segmented shrink and expand of Punica and S-LoRA, here one pair of GEMMs per slot present, on
CPU and GPU alike. Tokens without an adapter are in no group and get nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoraStack:
    """One projection's adapter slots (`lora/weights.py` fills them)."""

    a: torch.Tensor  # [slots, parts * R, K]
    b: torch.Tensor  # [slots, N, parts * R]


@dataclass
class LoraRows:
    """The tokens of a step that take an adapter, grouped: (slot, token indices on the
    device) per slot present."""

    groups: list[tuple[int, torch.Tensor]]

    @staticmethod
    def of(token_slots: np.ndarray, device: torch.device) -> LoraRows | None:
        """From each token's slot (-1: the base model); None when no token takes one."""
        slots = np.unique(token_slots[token_slots >= 0])
        if not len(slots):
            return None
        return LoraRows([(int(s), torch.from_numpy(np.nonzero(token_slots == s)[0]).to(device))
                         for s in slots])


def add_lora(out: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows) -> None:
    """out[tokens] += B[slot] @ (A[slot] @ x[tokens]) for each group, in place."""
    for slot, index in rows.groups:
        xs = x.index_select(0, index)
        delta = (xs @ stack.a[slot].T) @ stack.b[slot].T
        out.index_add_(0, index, delta.to(out.dtype))
