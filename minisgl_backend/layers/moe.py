"""Mixture-of-experts MLP (Qwen3-MoE): softmax router, top-k experts, weighted sum.

Every rank holds every expert with its intermediate dimension split (column/row parallel), so the
layer ends with one all-reduce like a dense MLP. The torch path loops over the experts that got
tokens (reading expert ids on the host); on a GPU the fused Triton kernels of `kernels/` run
instead, with no host synchronization, so MoE decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.distributed import all_reduce, get_tp_info
from minisgl_backend.layers.fast_ops import silu_and_mul, use_triton_kernels
from minisgl_backend.layers.linear import ReplicatedLinear, divide


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def experts_forward_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Reference: for each expert with tokens, silu(gate) * up, down, scale, scatter-add."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token_idx, slot = torch.where(ids == expert)
        y = F.linear(silu_and_mul(F.linear(x[token_idx], w13[expert])), w2[expert])
        y = y * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class MoEMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        local = divide(intermediate_size, get_tp_info().size, "moe_intermediate_size")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        # w13[e] = [gate rows; up rows] of expert e, w2[e] its down projection (local slices).
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if use_triton_kernels(x):  # grouped GEMMs over expert-sorted tokens, no host sync
            from kernels.fused_moe import fused_experts

            return all_reduce(fused_experts(x, self.w13, self.w2, weights, ids))
        return all_reduce(experts_forward_torch(x, self.w13, self.w2, weights, ids))
