"""Repetition, presence and frequency penalties applied to logits in one pass.

The torch path (`minisgl_backend.engine.controls`) gathers each penalized row's counts and
prompt mask and runs about ten element-wise kernels over [rows, vocab]; here every element of
the logits, the counts and the prompt mask is read once and the logits written once, in place.
The arithmetic is the torch path's, in float32: a token seen in the prompt or the output has a
positive logit divided by the repetition penalty and a negative one multiplied by it, then
`frequency * count + presence * (count > 0)` is subtracted (counts: output tokens only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _penalty_kernel(logits_ptr, logits_stride, batch_rows_ptr, table_rows_ptr, counts_ptr,
                    in_prompt_ptr, state_stride, rep_ptr, presence_ptr, frequency_ptr, vocab,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    b = tl.load(batch_rows_ptr + i).to(tl.int64)
    r = tl.load(table_rows_ptr + i).to(tl.int64)
    x = tl.load(logits_ptr + b * logits_stride + cols, mask=mask).to(tl.float32)
    count = tl.load(counts_ptr + r * state_stride + cols, mask=mask, other=0)
    seen = (count > 0) | (tl.load(in_prompt_ptr + r * state_stride + cols, mask=mask,
                                  other=0) != 0)
    rep = tl.load(rep_ptr + i)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - tl.load(frequency_ptr + i) * count.to(tl.float32) \
        - tl.load(presence_ptr + i) * (count > 0).to(tl.float32)
    tl.store(logits_ptr + b * logits_stride + cols,
             x.to(logits_ptr.dtype.element_ty), mask=mask)


def apply_penalties(logits: torch.Tensor, batch_rows: torch.Tensor, table_rows: torch.Tensor,
                    counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    block: int = 2048) -> None:
    """Penalize rows `batch_rows` of `logits` [bs, vocab] (any float dtype, in place; unit
    stride along the vocabulary) with the state rows `table_rows` of `counts` [rows, vocab]
    int32 and `in_prompt` [rows, vocab] bool; per penalized row float32 `repetition`,
    `presence`, `frequency`."""
    m, vocab = len(batch_rows), logits.shape[1]
    if m == 0:
        return
    assert logits.stride(1) == 1 and counts.stride(1) == 1 and in_prompt.stride(1) == 1
    assert counts.stride(0) == in_prompt.stride(0)
    _penalty_kernel[(m, triton.cdiv(vocab, block))](
        logits, logits.stride(0), batch_rows.contiguous(), table_rows.contiguous(), counts,
        in_prompt.view(torch.uint8), counts.stride(0), repetition.contiguous(),
        presence.contiguous(), frequency.contiguous(), vocab, BLOCK=block, num_warps=4)
