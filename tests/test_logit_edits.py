"""The edit kernels (`kernels/logit_edits.py`: penalties, logit bias, bad words and min_p) equal
the engine's torch path (`LogitControls.apply` on CPU tensors), in place and into a copy.
Without CUDA the kernels run in Triton's interpreter on CPU tensors; on a GPU compiled."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kernels.logit_edits import SPARSE_POSITIONS, _edit_kernel, apply_edits, min_p_scratch
from kernels.sampling import MinPFloor, apply_min_p_floor, sample_from_logits
from minisgl_backend.core import RowSampling, SamplingParams
from minisgl_backend.engine.controls import LogitControls, _EditRows
from minisgl_backend.engine.protocol import StepMessage
from tests.kernel_targets import devices

DEVICES = devices(_edit_kernel)
VOCAB, ROWS, POSITIONS = 5000, 8, 64
BATCH = np.array([6, 0, 2, 5, 1, 3])  # table rows of a batch: 0 and 3 edit nothing
NEXT = 40  # every row samples its token at position 40
PENALIZED = (2, 5)  # table rows with penalties (exact only in float32 interpreted: see below)


def _controls(device: str) -> LogitControls:
    """Rows 1, 2 biased (row 2 with an entry for token 0, the padding id), rows 2, 5, 6 with
    bad words of 1-3 tokens (some matching the token pool's context), rows 1 and 6 with
    min_p, rows 2 and 5 penalized (their first 20 tokens the prompt, the next 20 counted)."""
    pool = torch.zeros(ROWS, POSITIONS, dtype=torch.int32)
    gen = np.random.default_rng(3)
    pool[:, :NEXT] = torch.as_tensor(gen.integers(0, 50, (ROWS, NEXT)), dtype=torch.int32)
    pool[2, 25] = 4999  # a counted token in the last chunk, as the bias at 4999 of row 1
    pool = pool.to(device)
    controls = LogitControls(ROWS, VOCAB, pool)
    admitted = np.array([1, 2, 5, 6])
    admit = RowSampling.of([(SamplingParams(**p), 0) for p in (
        dict(min_p=0.1, temperature=0.7),
        dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
             frequency_penalty=0.2),
        dict(temperature=1.3, repetition_penalty=0.8, presence_penalty=-0.25),
        dict(min_p=0.3, temperature=0.5))], VOCAB)
    ctx = {r: pool[r, NEXT - 2:NEXT].tolist() for r in (2, 5, 6)}  # the last two tokens
    bans = [(2, [17]), (2, [ctx[2][1], 4000]), (5, [ctx[5][0], ctx[5][1], 4001]),
            (5, [ctx[5][0] + 1, ctx[5][1], 4002]), (6, [4003]), (6, [ctx[6][1], 17]),
            (6, [99, 4004])]
    bias = {1: {10: 2.5, 4999: -1.0, 17: 3.0}, 2: {0: 1.5, 4000: 4.0, 33: -0.5, 4095: 1.0,
                                                     4096: -2.0}}
    controls.admit(StepMessage(
        is_prefill=True, admit_rows=admitted.tolist(), admit=admit,
        prompt_rows=list(PENALIZED), prompt_counts=[20, 20],
        prompt_tokens=pool[list(PENALIZED), :20].flatten().tolist(),
        bias_rows=list(bias), bias_counts=[len(b) for b in bias.values()],
        bias_ids=[i for b in bias.values() for i in b],
        bias_values=[v for b in bias.values() for v in b.values()],
        ban_rows=[r for r, _ in bans], ban_lens=[len(t) for _, t in bans],
        ban_tokens=[t for _, seq in bans for t in seq]))
    penalized = np.array(PENALIZED)
    for position in range(20, NEXT):
        controls.record(penalized, torch.as_tensor(penalized, device=device),
                        pool[penalized, position].long(), np.full(2, position + 1))
    return controls


def _logits(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(len(BATCH), VOCAB, generator=gen) * 3).to(dtype)


def _torch_path(logits: torch.Tensor) -> torch.Tensor:
    controls = _controls("cpu")
    out = logits.clone()
    rows_t = torch.as_tensor(BATCH)
    edited, floor = controls.apply(out, BATCH, rows_t, torch.full((len(BATCH),), NEXT),
                                   np.full(len(BATCH), NEXT), leave_floor=True)
    assert edited is out and floor is None  # in place; the torch path applies min_p itself
    return out


def _check(got: torch.Tensor, original: torch.Tensor, expected: torch.Tensor,
           exact: bool) -> None:
    """`got` equals the torch path's `expected`: exactly, or (a GPU's float32 division,
    bfloat16 roundings) the penalized rows within rounding."""
    penalized = torch.as_tensor(np.isin(BATCH, PENALIZED))
    assert torch.equal(got[~penalized], expected[~penalized])
    tolerance = 0.0 if exact else 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[penalized].float(), expected[penalized].float(),
                               rtol=tolerance, atol=tolerance)
    # The case covers what it means to (batch index: table row 6, 0, 2, 5, 1, 3).
    for b in (1, 5):  # table rows 0 and 3 use nothing
        assert torch.equal(got[b], original[b])
    assert expected[2, 17].isinf() and expected[2, 4000].isinf()  # a ban after its bias
    assert expected[3, 4001].isinf() and not expected[3, 4002].isinf()  # 3-token context
    assert got[4, 10] == original[4, 10] + 2.5 or got[4, 10].isinf()  # row 1: bias + min_p
    assert got[4].isinf().sum() > VOCAB // 2 and got[0].isinf().sum() > VOCAB // 2
    assert (got[2] != original[2]).sum() > 30 and (got[3] != original[3]).sum() > 15


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1024, 4096])
@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
@pytest.mark.parametrize("sparse_limit", [SPARSE_POSITIONS, NEXT - 1], ids=["sparse", "dense"])
def test_kernels_equal_the_torch_path(device: str, dtype: torch.dtype, chunk: int,
                                      copy: bool, sparse_limit: int) -> None:
    """Every edit in one kernel over vocabulary chunks (5 or 2 of them: bias entries and
    bans on both sides of a chunk's edge), in place or into a copy that also holds the rows
    without edits, while the raw logits stay as they were. The penalties either sparse (the
    row's 40 tokens, repeated ids among them, read from the token pool) or dense (the rows
    are one token past the limit: counts and prompt mask read over the vocabulary)."""
    original = _logits(dtype)
    expected = _torch_path(original)
    controls = _controls(device)
    logits = original.clone().to(device)
    out = torch.full_like(logits, float("nan")) if copy else logits
    edits = controls._edit_rows(BATCH, every_row=copy)
    apply_edits(logits, out, edits.program_rows, torch.as_tensor(BATCH, device=device),
                torch.full((len(BATCH),), NEXT, device=device), edits.factors, edits.tables,
                edits.flags, chunk=chunk, min_p=_floor_state(edits, chunk, device),
                sparse_limit=sparse_limit)
    _check(out.cpu(), original, expected, exact=device == "cpu" and dtype == torch.float32)
    if copy:
        assert torch.equal(logits.cpu(), original)


def _floor_state(edits: _EditRows, chunk: int, device: str) -> MinPFloor:
    """The batch's min_p floor state with chunk maxima for `chunk`-wide programs."""
    assert edits.min_p is not None
    return dataclasses.replace(edits.min_p, chunk_max=min_p_scratch(
        edits.program_rows.shape[1], VOCAB, torch.device(device), chunk))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
def test_min_p_floor_left_to_sampling_samples_as_written(device: str, copy: bool) -> None:
    """The edit kernels may leave min_p's floor to the sampling kernels, which apply it as
    they read the logits: the tokens drawn (12 seeds) equal those drawn from logits with the
    floor written, every one above its row's floor, and the logits stay unfloored."""
    controls = _controls(device)
    logits = _logits(torch.float32).to(device)
    out = torch.empty_like(logits) if copy else logits
    edits = controls._edit_rows(BATCH, every_row=copy)
    apply_edits(logits, out, edits.program_rows, torch.as_tensor(BATCH, device=device),
                torch.full((len(BATCH),), NEXT, device=device), edits.factors, edits.tables,
                edits.flags, min_p=edits.min_p, floor=False)
    assert not out.isinf().sum(dim=1).gt(VOCAB // 2).any()  # not floored yet
    floored = out.clone()
    apply_min_p_floor(floored, edits.min_p)
    expected = _torch_path(_logits(torch.float32))
    _check(floored.cpu(), _logits(torch.float32), expected, exact=False)
    temperature = torch.full((len(BATCH),), 0.7, device=device)
    temperature[2] = 0.0  # a greedy row among them
    for seed in range(12):
        seeds = torch.arange(len(BATCH), device=device) * 1000 + seed
        position = torch.full((len(BATCH),), NEXT, device=device)
        left = sample_from_logits(out, temperature, seed=seeds, position=position,
                                  min_p=edits.min_p)
        written = sample_from_logits(floored, temperature, seed=seeds, position=position)
        assert torch.equal(left, written)
        assert not floored.gather(1, left.unsqueeze(1)).isinf().any()


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("keep_raw", [False, True])
def test_the_engine_path_uses_the_kernels_on_a_gpu(device: str, keep_raw: bool) -> None:
    """`LogitControls.apply` on the GPU (the kernels) equals the torch path on CPU; with
    `keep_raw` it returns an edited copy and leaves the logits raw."""
    original = _logits(torch.float32)
    controls = _controls(device)
    logits = original.clone().to(device)
    edited, floor = controls.apply(logits, BATCH, torch.as_tensor(BATCH, device=device),
                                   torch.full((len(BATCH),), NEXT, device=device),
                                   np.full(len(BATCH), NEXT), keep_raw=keep_raw)
    assert (edited is logits) != keep_raw and floor is None
    _check(edited.cpu(), original, _torch_path(original), exact=False)
    if keep_raw:
        assert torch.equal(logits.cpu(), original)


def test_the_torch_path_keeps_the_raw_logits_too() -> None:
    original = _logits(torch.float32)
    controls = _controls("cpu")
    logits = original.clone()
    edited, _ = controls.apply(logits, BATCH, torch.as_tensor(BATCH),
                               torch.full((len(BATCH),), NEXT), np.full(len(BATCH), NEXT),
                               keep_raw=True)
    assert torch.equal(logits, original)
    assert torch.equal(edited, _torch_path(original))


def test_rows_that_only_report_take_no_edit() -> None:
    """Log-probabilities and generation logits read the raw logits: such rows `report`, and
    only rows with an edit (here min_p) are `edited`, so `apply` and `record` skip the others'
    steps."""
    controls = LogitControls(ROWS, VOCAB, torch.zeros(ROWS, POSITIONS, dtype=torch.int32))
    rows = np.array([1, 4, 6, 7])
    admit = RowSampling.of([(SamplingParams(**p), 0) for p in (
        dict(logprobs=2, temperature=1.0), dict(return_generation_logits=True, temperature=1.0),
        dict(logprobs=0, min_p=0.2, temperature=1.0), dict(temperature=1.0))], VOCAB)
    controls.admit(StepMessage(is_prefill=True, admit_rows=rows.tolist(), admit=admit))
    assert controls.params.reports[rows].tolist() == [True, True, True, False]
    assert controls.edited[rows].tolist() == [False, False, True, False]
