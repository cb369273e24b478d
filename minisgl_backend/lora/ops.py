"""The LoRA delta of a batch whose rows take different adapters (or none).

A step's tokens are grouped by adapter slot once (`LoraRows`, built by the engine); each adapted
projection then adds, group by group, `(x[g] @ A[slot].T) @ B[slot].T` to its output: the
segmented shrink and expand of Punica and S-LoRA. On a GPU the project's Triton kernels
(`kernels/lora.py`) run every group in two launches of a grid fixed by the batch size, which CUDA
graphs can replay; on CPU the torch reference runs one pair of GEMMs per slot present. Tokens
without an adapter are in no group and get nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl_backend.device_copy import host_to_device


@dataclass
class LoraStack:
    """One projection's adapter slots (`lora/weights.py` fills them)."""

    a: torch.Tensor  # [slots, parts * R, K]
    b: torch.Tensor  # [slots, N, parts * R]


@dataclass
class LoraRows:
    """The tokens of a step that take an adapter: on CPU grouped as (slot, token indices) per
    slot present; on a GPU as the kernels' block table (`kernels.lora.split_blocks`)."""

    groups: list[tuple[int, torch.Tensor]]
    blocks: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def of(token_slots: np.ndarray, device: torch.device) -> LoraRows | None:
        """From each token's slot (-1: the base model); None when no token takes one."""
        if not (token_slots >= 0).any():
            return None
        if device.type == "cuda":
            from kernels.lora import pack_blocks, split_blocks

            packed, num_blocks = pack_blocks(token_slots)
            return LoraRows([], split_blocks(host_to_device(packed, device), len(token_slots),
                                             num_blocks))
        slots = np.unique(token_slots[token_slots >= 0])
        return LoraRows([(int(s), torch.from_numpy(np.nonzero(token_slots == s)[0]).to(device))
                         for s in slots])


def add_lora(out: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows) -> None:
    """out[tokens] += B[slot] @ (A[slot] @ x[tokens]) for each group, in place."""
    if rows.blocks is not None:
        from kernels.lora import lora_shrink_expand

        lora_shrink_expand(out, x.contiguous(), stack.a, stack.b, rows.blocks)
        return
    for slot, index in rows.groups:
        xs = x.index_select(0, index)
        delta = (xs @ stack.a[slot].T) @ stack.b[slot].T
        out.index_add_(0, index, delta.to(out.dtype))
