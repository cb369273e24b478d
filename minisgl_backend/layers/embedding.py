"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.distributed import all_gather_last_dim, all_reduce, get_tp_info


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(start, padded shard size) of this rank's slice; the last shard may run past the vocab."""
    tp = get_tp_info()
    shard = -(-vocab_size // tp.size)
    return tp.rank * shard, shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, shard = vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(shard, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the full vocabulary on every rank (all-gather of the per-rank slices)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        _, shard = vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(shard, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(x, self.weight))
        return logits[..., : self.vocab_size]
