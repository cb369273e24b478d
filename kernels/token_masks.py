"""Grammar token masks applied to a step's logits in one kernel.

A mask row is xgrammar's bitmask: int32 words, bit `t % 32` of word `t // 32` set when token
`t` may be sampled. Programs over (mask row, vocabulary chunk) set every disallowed logit of
the row to -inf. Mask row i belongs to logits row `rows[i]` (every row in order when `rows` is
None). This is xgrammar's own Triton kernel's rule, without its launcher's host time (device
properties looked up twice, argument checks), which a guided decode step waits for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import DirectLaunch, cdiv

BLOCK = 4096  # tokens a program covers (128 mask words)


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, mask_ptr, mask_stride, rows_ptr, vocab,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    inside = offs < vocab
    words = tl.load(mask_ptr + i.to(tl.int64) * mask_stride + offs // 32, mask=inside, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    # The whole block is read and written back: a store masked per logit is not vectorized.
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=inside)
    y = tl.where(banned, float("-inf"), x.to(tl.float32))
    tl.store(logits_ptr + row * logits_stride + offs, y.to(x.dtype), mask=inside)


_launch_bitmask = DirectLaunch(_apply_bitmask_kernel)


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor,
                  rows: torch.Tensor | None = None) -> None:
    """Disallowed tokens to -inf, in place: mask row i ([n, words] int32, on the logits'
    device) covers logits row `rows[i]` (int32 or int64), or row i when `rows` is None."""
    n, vocab = masks.shape[0], logits.shape[-1]
    if n == 0:
        return
    _launch_bitmask((n, cdiv(vocab, BLOCK)),
        logits, logits.stride(0), masks, masks.stride(0), rows if rows is not None else masks,
        vocab, HAS_ROWS=rows is not None, BLOCK=BLOCK)
