"""Temperature sampling (and greedy rows) straight from the logits: one program per row.

The torch sampler (`minisgl_backend.engine.sampler`) runs ~10 kernels over the whole
[batch, vocab] float32 logits per step (scale, softmax, cumsum, searchsorted, argmax, ...),
each reading and most writing 150 MB at batch 256 with Qwen3's vocabulary. This kernel reads
each row at most twice and writes one id: an online max and sum of exp over the row, then a
scan that stops at the first token whose cumulative mass passes `uniform * total`, the same
inverse-CDF rule in token-id order as the torch path (float rounding may move a pick that
lies within rounding of a boundary). Rows whose temperature is 0 or whose top_k is 1 take the
first index of the largest logit (torch.argmax's tie rule). Top-k / top-p rows are not
handled here: they need the sorted path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, uniform_ptr, out_ptr,
                   vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offsets = tl.arange(0, BLOCK)
    temperature = tl.load(temperature_ptr + row)
    greedy = (temperature <= 0) | (tl.load(top_k_ptr + row) == 1)
    if greedy:
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        best_idx = tl.min(tl.zeros([BLOCK], tl.int32), 0)
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            block_best = tl.max(x, 0)
            first = tl.min(tl.where(x == block_best, cols, vocab), 0)
            better = block_best > best  # strictly: an earlier block keeps a tie
            best_idx = tl.where(better, first, best_idx)
            best = tl.maximum(best, block_best)
        tl.store(out_ptr + row, best_idx.to(tl.int64))
    else:
        # Pass 1: max and sum of exp(x - max) of the scaled row, in one read (online softmax).
        run_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        run_sum = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            x = x / temperature
            new_max = tl.maximum(run_max, tl.max(x, 0))
            # -inf entries (padding, masked stop ids) add nothing, also while the max is -inf.
            p = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_max))
            scale = tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
            run_sum = run_sum * scale + tl.sum(p, 0)
            run_max = new_max
        target = (tl.load(uniform_ptr + row).to(tl.float64) * run_sum.to(tl.float64)
                  ).to(tl.float32)
        # Pass 2: the first token whose cumulative mass exceeds the target; it stops there.
        cum = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        choice = tl.min(tl.full([BLOCK], -1, tl.int32), 0)
        last_kept = tl.min(tl.zeros([BLOCK], tl.int32), 0)  # rounding fallback: never a p=0
        start = tl.min(tl.zeros([BLOCK], tl.int32), 0)
        while (start < vocab) & (choice < 0):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            x = x / temperature
            p = tl.where(x == float("-inf"), 0.0, tl.exp(x - run_max))
            cdf = cum + tl.cumsum(p, 0)
            hit = tl.min(tl.where(cdf > target, cols, vocab), 0)
            choice = tl.where(hit < vocab, hit, choice)
            last_kept = tl.maximum(last_kept, tl.max(tl.where(p > 0, cols, 0), 0))
            cum = tl.max(cdf, 0)
            start += BLOCK
        choice = tl.where(choice < 0, last_kept, choice)
        tl.store(out_ptr + row, choice.to(tl.int64))


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       uniform: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """One token id per row of `logits` [bs, vocab] (int64 [bs]).

    temperature [bs] (<= 0: greedy), top_k [bs] (only 1 is looked at: greedy), uniform [bs]
    in (0, 1): the row's draw for the inverse CDF.
    """
    bs, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs == 0:
        return out
    _sample_kernel[(bs,)](logits, logits.stride(0), temperature.contiguous(),
                          top_k.contiguous(), uniform.contiguous(), out, vocab,
                          BLOCK=block, num_warps=8)
    return out
