"""The Triton penalty kernel (`kernels/penalties.py`) against the torch path it replaces.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors; with CUDA compiled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import is_interpreted
from kernels.penalties import _penalty_kernel, apply_penalties
from minisgl_backend.engine.controls import LogitControls, RowParams
from minisgl_backend.engine.protocol import StepMessage

INTERPRETED = is_interpreted(_penalty_kernel)
DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU runs need the kernels imported with TRITON_INTERPRET=1")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")]),
]
VOCAB, ROWS = 3000, 6  # the vocabulary spans two 2048-wide blocks, the last one partial


def _controls(device: str) -> tuple[LogitControls, np.ndarray]:
    """Rows 1, 3, 4 penalized with prompts and some generated tokens counted."""
    params = RowParams(ROWS)
    pool = torch.zeros(ROWS, 64, dtype=torch.int32, device=device)
    controls = LogitControls(params, ROWS, VOCAB, pool)
    rows = np.array([1, 3, 4])
    admit = {"repetition_penalty": [1.3, 0.7, 1.0], "presence_penalty": [0.5, -1.0, 0.0],
             "frequency_penalty": [0.25, 0.0, -2.0]}
    params.admit(rows, admit)
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, VOCAB, 20) for _ in rows]
    controls.admit(StepMessage(is_prefill=True, admit_rows=rows.tolist(), admit=admit,
                               prompt_rows=rows.tolist(), prompt_counts=[20] * 3,
                               prompt_tokens=np.concatenate(prompts).tolist()))
    for _ in range(30):  # generated tokens, some repeated
        tokens = torch.as_tensor(gen.integers(0, 400, len(rows)), dtype=torch.int32)
        controls.record(rows, torch.as_tensor(rows).to(device), tokens.to(device),
                        np.full(len(rows), 100))
    return controls, rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_path(device: str, dtype: torch.dtype) -> None:
    controls, rows = _controls(device)
    assert controls.counts is not None and controls.in_prompt is not None
    batch = np.array([3, 0, 1, 4, 5])  # table rows of a batch; 0 and 5 are not penalized
    logits = (torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
              ).to(dtype).to(device)
    original = logits.clone().cpu().float()
    expected = original.clone()
    penalized = np.isin(batch, rows)
    controls_cpu, _ = _controls("cpu")
    controls_cpu._penalize(expected, batch, penalized)  # the torch path (CPU tensors)
    which = np.nonzero(penalized)[0]
    p = controls.params
    factors = [torch.tensor(p[name][batch[which]], dtype=torch.float32, device=device)
               for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
    apply_penalties(logits, torch.as_tensor(which, device=device),
                    torch.as_tensor(batch[which], device=device), controls.counts,
                    controls.in_prompt, *factors)
    got = logits.cpu().float()
    assert torch.equal(got[~torch.as_tensor(penalized)],
                       expected[~torch.as_tensor(penalized)].to(dtype).float())
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected.to(dtype).float(), rtol=tolerance, atol=tolerance)
    changed = (got != original).any(dim=1)
    assert changed.tolist() == penalized.tolist()  # every penalized row moved, no other one
