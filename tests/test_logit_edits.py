"""The logit-bias, bad-word and min_p kernels (`kernels/logit_edits.py`) equal the engine's torch
path (`LogitControls.apply` on CPU tensors). Without CUDA the kernels run in Triton's
interpreter on CPU tensors; on a GPU compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.logit_edits import _min_p_floor_kernel, apply_min_p, apply_sparse_edits
from minisgl_backend.engine.controls import LogitControls, RowParams
from minisgl_backend.engine.protocol import StepMessage
from tests.kernel_targets import devices

DEVICES = devices(_min_p_floor_kernel)
VOCAB, ROWS, POSITIONS = 5000, 8, 64
BATCH = np.array([6, 0, 2, 5, 1, 3])  # table rows of a batch: 0 and 3 edit nothing
NEXT = 40  # every row samples its token at position 40


def _controls(device: str) -> LogitControls:
    """Rows 1, 2 biased (row 2 with an entry for token 0, the padding id), rows 2, 5, 6 with
    bad words of 1-3 tokens (some matching the token pool's context), rows 1 and 6 with
    min_p."""
    params = RowParams(ROWS)
    pool = torch.zeros(ROWS, POSITIONS, dtype=torch.int32)
    gen = np.random.default_rng(3)
    pool[:, :NEXT] = torch.as_tensor(gen.integers(0, 50, (ROWS, NEXT)), dtype=torch.int32)
    pool = pool.to(device)
    controls = LogitControls(params, ROWS, VOCAB, pool)
    admitted = np.array([1, 2, 5, 6])
    admit = {"min_p": [0.1, 0.0, 0.0, 0.3], "temperature": [0.7, 1.0, 1.3, 0.5]}
    params.admit(admitted, admit)
    ctx = {r: pool[r, NEXT - 2:NEXT].tolist() for r in (2, 5, 6)}  # the last two tokens
    bans = [(2, [17]), (2, [ctx[2][1], 4000]), (5, [ctx[5][0], ctx[5][1], 4001]),
            (5, [ctx[5][0] + 1, ctx[5][1], 4002]), (6, [4003]), (6, [ctx[6][1], 17]),
            (6, [99, 4004])]
    bias = {1: {10: 2.5, 4999: -1.0, 17: 3.0}, 2: {0: 1.5, 4000: 4.0, 33: -0.5}}
    msg = StepMessage(
        is_prefill=True, admit_rows=admitted.tolist(), admit=admit,
        bias_rows=list(bias), bias_counts=[len(b) for b in bias.values()],
        bias_ids=[i for b in bias.values() for i in b],
        bias_values=[v for b in bias.values() for v in b.values()],
        ban_rows=[r for r, _ in bans], ban_lens=[len(t) for _, t in bans],
        ban_tokens=[t for _, seq in bans for t in seq])
    controls.admit(msg)
    return controls


def _logits(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(len(BATCH), VOCAB, generator=gen) * 3).to(dtype)


def _torch_path(logits: torch.Tensor) -> torch.Tensor:
    controls = _controls("cpu")
    out = logits.clone()
    rows_t = torch.as_tensor(BATCH)
    controls.apply(out, BATCH, rows_t, torch.full((len(BATCH),), NEXT),
                   np.full(len(BATCH), NEXT))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_torch_path(device: str, dtype: torch.dtype) -> None:
    original = _logits(dtype)
    expected = _torch_path(original)
    controls = _controls(device)
    logits = original.clone().to(device)
    rows_t = torch.as_tensor(BATCH, device=device)
    next_t = torch.full((len(BATCH),), NEXT, device=device)
    edited = np.nonzero(controls.biased[BATCH] | controls.banned[BATCH])[0]
    edited_t = torch.as_tensor(edited, device=device)
    apply_sparse_edits(logits, edited_t, rows_t[edited_t], next_t[edited_t],
                       (controls.bias_ids, controls.bias_values), controls.ban_tokens,
                       controls.token_pool)
    which = np.nonzero(controls.min_p_rows[BATCH])[0]
    p = controls.params
    offsets = torch.as_tensor(p["temperature"][BATCH[which]] * np.log(p["min_p"][BATCH[which]]),
                              dtype=torch.float32, device=device)
    apply_min_p(logits, torch.as_tensor(which, device=device), offsets, chunk=1024)  # 5 chunks
    got = logits.cpu()
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The case covers what it means to (batch index: table row 6, 0, 2, 5, 1, 3).
    for b in (1, 5):  # table rows 0 and 3 use nothing
        assert torch.equal(got[b], original[b])
    assert got[2, 0] == original[2, 0] + 1.5 and got[2, 33] == original[2, 33] - 0.5
    assert got[2, 17].isinf() and got[2, 4000].isinf()  # a ban after a bias of the same token
    assert got[3, 4001].isinf() and not got[3, 4002].isinf()  # 3-token context: hit, miss
    assert got[4, 10] == original[4, 10] + 2.5 or got[4, 10].isinf()  # row 1: bias + min_p
    assert got[4].isinf().sum() > VOCAB // 2 and got[0].isinf().sum() > VOCAB // 2


@pytest.mark.parametrize("device", DEVICES[1:])
def test_the_engine_path_uses_the_kernels_on_a_gpu(device: str) -> None:
    """`LogitControls.apply` on the GPU (the kernels) equals the torch path on CPU."""
    original = _logits(torch.float32)
    controls = _controls(device)
    logits = original.clone().to(device)
    controls.apply(logits, BATCH, torch.as_tensor(BATCH, device=device),
                   torch.full((len(BATCH),), NEXT, device=device), np.full(len(BATCH), NEXT))
    torch.testing.assert_close(logits.cpu(), _torch_path(original), rtol=0, atol=0)


def test_rows_that_only_report_take_no_edit() -> None:
    """Log-probabilities and generation logits read the raw logits: such rows are `reported`,
    and only rows with an edit (here min_p) are `edited`, so `apply` and `record` skip the
    others' steps."""
    params = RowParams(ROWS)
    controls = LogitControls(params, ROWS, VOCAB, torch.zeros(ROWS, POSITIONS, dtype=torch.int32))
    rows = np.array([1, 4, 6, 7])
    admit = {"logprobs": [2, -1, 0, -1], "return_generation_logits": [0, 1, 0, 0],
             "min_p": [0.0, 0.0, 0.2, 0.0], "temperature": [1.0, 1.0, 1.0, 1.0]}
    params.admit(rows, admit)
    controls.admit(StepMessage(is_prefill=True, admit_rows=rows.tolist(), admit=admit))
    assert controls.reported[rows].tolist() == [True, True, True, False]
    assert controls.edited[rows].tolist() == [False, False, True, False]
