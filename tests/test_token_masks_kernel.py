"""The grammar-mask kernel (kernels/token_masks.py) against xgrammar's own CPU application:
interpreted on CPU tensors, compiled on a GPU; every row in order, or some rows by index; a
vocabulary that ends inside a mask word. On a GPU also the engine's way: masks copied straight
from the page-locked shared buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.token_masks import _apply_bitmask_kernel, apply_bitmask
from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.grammar import apply_token_masks, mask_words
from tests.kernel_targets import devices, gpu_marks

VOCAB = 5000  # two programs a row, the second partial; the last word half used


def _case(rows: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    gen = np.random.default_rng(seed)
    logits = torch.from_numpy(gen.standard_normal((rows, VOCAB)).astype(np.float32))
    masks = gen.integers(-2**31, 2**31, size=(rows, mask_words(VOCAB)), dtype=np.int64)
    masks = masks.astype(np.int32)
    masks[0] = -1  # everything allowed
    masks[-1] = 0  # nothing allowed
    return logits, masks


def _reference(logits: torch.Tensor, masks: np.ndarray, rows: list[int] | None) -> torch.Tensor:
    import xgrammar as xgr

    out = logits.float().clone()
    full = masks
    if rows is not None:
        full = np.full((logits.shape[0], masks.shape[1]), -1, dtype=np.int32)
        full[rows] = masks
    xgr.apply_token_bitmask_inplace(out, torch.from_numpy(full), vocab_size=VOCAB,
                                    indices=rows)
    return out


@pytest.mark.parametrize("device", devices(_apply_bitmask_kernel))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [3, 0, 5]], ids=["in-order", "indexed"])
def test_apply_bitmask_equals_xgrammar(device: str, dtype: torch.dtype,
                                       rows: list[int] | None) -> None:
    logits, masks = _case(6, seed=len(rows or ()))
    masks = masks[: len(rows)] if rows is not None else masks
    logits = logits.to(dtype)
    got = logits.to(device)
    apply_bitmask(got, torch.from_numpy(masks).to(device),
                  torch.tensor(rows, device=device) if rows is not None else None)
    expected = _reference(logits, masks, rows)
    assert torch.equal(torch.isinf(got.cpu().float()), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    assert torch.equal(got.cpu().float()[kept], logits.float()[kept])  # others untouched


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 1]], ids=["in-order", "indexed"])
def test_apply_token_masks_cpu_path_equals_xgrammar(rows: list[int]) -> None:
    logits, masks = _case(4, seed=7)
    masks = masks[: len(rows)]
    got = logits.clone()
    apply_token_masks(got, np.asarray(rows), masks)
    assert torch.equal(got, _reference(logits, masks, None if rows == [0, 1, 2, 3] else rows))


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 1]], ids=["in-order", "indexed"])
@pytest.mark.parametrize("_", [pytest.param(0, marks=gpu_marks(_apply_bitmask_kernel))],
                         ids=["cuda"])
def test_masks_from_the_page_locked_buffer_equal_xgrammar(rows: list[int], _: int) -> None:
    logits, masks = _case(4, seed=11)
    buffer = MaskBuffer(slots=4, words=mask_words(VOCAB))
    assert buffer.lock_pages() and buffer.page_locked
    view = buffer.view(1, len(rows))
    view[:] = masks[: len(rows)]
    got = logits.cuda()
    apply_token_masks(got, np.asarray(rows), view, page_locked=True)
    expected = _reference(logits, masks[: len(rows)], None if rows == [0, 1, 2, 3] else rows)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("_", [pytest.param(0, marks=gpu_marks(_apply_bitmask_kernel))],
                         ids=["cuda"])
def test_a_collected_buffer_unlocks_its_pages(_: int) -> None:
    """Buffers come and go (engines of one process): each new one is page-locked again."""
    for _round in range(3):
        buffer = MaskBuffer(slots=4, words=mask_words(VOCAB))
        assert buffer.lock_pages()
        del buffer
