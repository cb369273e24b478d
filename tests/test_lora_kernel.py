"""The grouped LoRA shrink/expand kernels equal the torch reference (`lora.ops.add_lora`), on
CPU through Triton's interpreter and, where there is one, on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.lora import BLOCK_T, lora_blocks, lora_shrink_expand
from minisgl_backend.lora.ops import LoraRows, LoraStack, add_lora

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [("cpu", torch.float32), pytest.param("cuda", torch.float32, marks=GPU),
         pytest.param("cuda", torch.bfloat16, marks=GPU)]


def test_blocks_group_tokens_by_slot() -> None:
    slots = np.array([2, -1, 0, 2, 0, -1] + [1] * (BLOCK_T + 3))
    order, block_slot, start, count = lora_blocks(slots)
    assert list(slots[order]) == sorted(s for s in slots if s >= 0)
    assert list(block_slot) == [0, 1, 1, 2]
    assert list(count) == [2, BLOCK_T, 3, 2] and list(start) == [0, 2, 2 + BLOCK_T, 5 + BLOCK_T]


@pytest.mark.parametrize("device, dtype", CASES)
def test_kernels_equal_the_reference(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, k, n, rank, num_slots = 37, 96, 80, 24, 3
    x = torch.randn(tokens, k, generator=gen).to(device, dtype)
    stack = LoraStack(torch.randn(num_slots, rank, k, generator=gen).to(device, dtype) * 0.1,
                      torch.randn(num_slots, n, rank, generator=gen).to(device, dtype) * 0.1)
    token_slots = np.random.default_rng(1).integers(-1, num_slots, tokens)
    base = torch.randn(tokens, n, generator=gen).to(device, dtype)
    expected = base.clone()
    add_lora(expected, x, stack, LoraRows.of(token_slots, torch.device(device)))
    got = base.clone()
    arrays = lora_blocks(token_slots)
    order, block_slot, start, count = (torch.from_numpy(a).to(device) for a in arrays)
    lora_shrink_expand(got, x, stack.a, stack.b, order, block_slot, start, count)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    untouched = token_slots < 0
    assert torch.equal(got[torch.from_numpy(untouched).to(device)],
                       base[torch.from_numpy(untouched).to(device)])
