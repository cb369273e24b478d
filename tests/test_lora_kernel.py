"""The grouped LoRA shrink/expand kernels equal the torch reference (`lora.ops.add_lora`), on
CPU through Triton's interpreter and, where there is one, on a GPU; with the exact block table
of an eager step and with the padded one a CUDA graph replays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.lora import BLOCK_T, lora_shrink_expand, max_blocks, pack_blocks, split_blocks
from minisgl_backend.lora.ops import LoraRows, LoraStack, add_lora

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Under the interpreter (no GPU) the kernels take CPU tensors; compiled, CUDA ones.
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels are compiled")
CASES = [pytest.param("cpu", torch.float32, marks=INTERPRETED),
         pytest.param("cuda", torch.float32, marks=GPU),
         pytest.param("cuda", torch.bfloat16, marks=GPU)]


def test_blocks_group_tokens_by_slot() -> None:
    slots = np.array([2, -1, 0, 2, 0, -1] + [1] * (BLOCK_T + 3))
    packed, num_blocks = pack_blocks(slots)
    order, block_slot, start, count = (t.numpy() for t in split_blocks(
        torch.from_numpy(packed), len(slots), num_blocks))
    assert num_blocks == 4
    assert list(slots[order[: (slots >= 0).sum()]]) == sorted(s for s in slots if s >= 0)
    assert list(block_slot) == [0, 1, 1, 2]
    assert list(count) == [2, BLOCK_T, 3, 2] and list(start) == [0, 2, 2 + BLOCK_T, 5 + BLOCK_T]


def test_padded_table_keeps_the_blocks_and_adds_empty_ones() -> None:
    slots = np.array([3, 3, -1, 0] + [1] * BLOCK_T)
    capacity = max_blocks(32, 4)
    packed, num_blocks = pack_blocks(slots, 32, capacity)
    assert packed.shape == (32 + 3 * capacity,)
    _, block_slot, _, count = (t.numpy() for t in split_blocks(
        torch.from_numpy(packed), 32, capacity))
    assert list(block_slot[:num_blocks]) == [0, 1, 3] and list(count[:num_blocks]) == [1, 16, 2]
    assert not count[num_blocks:].any()


@pytest.mark.parametrize("seed", range(4))
def test_block_count_never_exceeds_the_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for tokens in (1, 7, 16, 17, 64, 100):
        for num_slots in (1, 3, 8):
            slots = rng.integers(-1, num_slots, tokens)
            assert pack_blocks(slots)[1] <= max_blocks(tokens, num_slots)


@pytest.mark.parametrize("padded, k", [(False, 96), (True, 96), (False, 600)])  # 600: split K
@pytest.mark.parametrize("device, dtype", CASES)
def test_kernels_equal_the_reference(device: str, dtype: torch.dtype, padded: bool,
                                     k: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, n, rank, num_slots = 37, 80, 24, 3
    x = torch.randn(tokens, k, generator=gen).to(device, dtype)
    stack = LoraStack(torch.randn(num_slots, rank, k, generator=gen).to(device, dtype) * 0.1,
                      torch.randn(num_slots, n, rank, generator=gen).to(device, dtype) * 0.1)
    token_slots = np.random.default_rng(1).integers(-1, num_slots, tokens)
    base = torch.randn(tokens, n, generator=gen).to(device, dtype)
    # The torch reference, on CPU in float32 from the same inputs.
    expected = base.float().cpu().clone()
    add_lora(expected, x.float().cpu(), LoraStack(stack.a.float().cpu(), stack.b.float().cpu()),
             LoraRows.of(token_slots, torch.device("cpu")))
    capacity = (64, max_blocks(64, num_slots)) if padded else (None, None)
    packed, num_blocks = pack_blocks(token_slots, *capacity)
    table = split_blocks(torch.from_numpy(packed).to(device), capacity[0] or tokens,
                         capacity[1] or num_blocks)
    got = base.clone()
    lora_shrink_expand(got, x, stack.a, stack.b, table)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), expected, rtol=tol, atol=tol)
    untouched = torch.from_numpy(token_slots < 0).to(device)
    assert torch.equal(got[untouched], base[untouched])
