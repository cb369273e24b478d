"""The three ways the engine applies penalties agree: the sparse torch path (only the tokens a
row has seen, read from its token pool), the dense torch path (long sequences: every
vocabulary entry) and the edit kernel (`kernels/logit_edits.py`, GPU; without CUDA it runs in
Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.logit_edits import _edit_kernel, apply_edits
from minisgl_backend.core import RowSampling, SamplingParams
from minisgl_backend.engine.controls import BatchRows, LogitControls
from minisgl_backend.engine.protocol import StepMessage
from tests.kernel_targets import devices

DEVICES = devices(_edit_kernel)
VOCAB, ROWS = 3000, 6  # the vocabulary spans two 2048-wide blocks, the last one partial


def _controls(device: str) -> tuple[LogitControls, np.ndarray]:
    """Rows 1, 3, 4 penalized with prompts and some generated tokens counted."""
    pool = torch.zeros(ROWS, 64, dtype=torch.int32, device=device)
    controls = LogitControls(ROWS, VOCAB, pool)
    rows = np.array([1, 3, 4])
    admit = RowSampling.of([(SamplingParams(repetition_penalty=r, presence_penalty=p,
                                            frequency_penalty=f), 0)
                            for r, p, f in ((1.3, 0.5, 0.25), (0.7, -1.0, 0.0),
                                            (1.0, 0.0, -2.0))], VOCAB)
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, VOCAB, 20) for _ in rows]
    controls.admit(StepMessage(is_prefill=True, admit_rows=rows.tolist(), admit=admit,
                               prompt_rows=rows.tolist(), prompt_counts=[20] * 3,
                               prompt_tokens=np.concatenate(prompts).tolist()))
    for step in range(30):  # generated tokens, some repeated, kept in the token pool too
        tokens = torch.as_tensor(gen.integers(0, 400, len(rows)), dtype=torch.int32)
        tokens = tokens.to(device)
        pool[torch.as_tensor(rows, device=device), 20 + step] = tokens
        controls.record(rows, torch.as_tensor(rows, device=device), tokens,
                        np.full(len(rows), 21 + step))
    return controls, rows


SEQ_LEN = 50  # 20 prompt tokens + 30 generated
BATCH = np.array([3, 0, 1, 4, 5])  # table rows of a batch; 0 and 5 are not penalized


def _logits(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(len(BATCH), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
            ).to(dtype)


def _penalized(controls: LogitControls, logits: torch.Tensor, seq_len: int) -> torch.Tensor:
    out = logits.clone()
    batch = BatchRows(BATCH, torch.as_tensor(BATCH), torch.full((len(BATCH),), seq_len),
                      np.full(len(BATCH), seq_len))
    controls._penalize(out, batch, np.isin(BATCH, [1, 3, 4]))
    return out


def test_sparse_path_equals_dense_path() -> None:
    controls, _ = _controls("cpu")
    logits = _logits()
    sparse = _penalized(controls, logits, SEQ_LEN)  # 2 * 50 < vocabulary: sparse
    dense = _penalized(controls, logits, VOCAB)  # "long" rows: dense over the vocabulary
    assert torch.equal(sparse, dense)
    assert (sparse != logits).any(dim=1).tolist() == [True, False, True, True, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_path(device: str, dtype: torch.dtype) -> None:
    controls, rows = _controls(device)
    assert controls.counts is not None and controls.in_prompt is not None
    original = _logits(dtype)
    expected = _penalized(_controls("cpu")[0], original.float(), VOCAB).to(dtype).float()
    logits = original.clone().to(device)
    penalized = np.isin(BATCH, rows)
    edits = controls._edit_rows(BATCH, every_row=False)
    apply_edits(logits, logits, edits.program_rows, torch.as_tensor(BATCH, device=device),
                torch.full((len(BATCH),), SEQ_LEN, device=device), edits.factors,
                edits.tables, edits.flags)
    got = logits.cpu().float()
    unpenalized = torch.as_tensor(~penalized)
    assert torch.equal(got[unpenalized], original.float()[unpenalized])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    changed = (got != original.float()).any(dim=1)
    assert changed.tolist() == penalized.tolist()  # every penalized row moved, no other one
