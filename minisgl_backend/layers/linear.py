"""Linear layers split across tensor-parallel ranks (Megatron style).

Weights are created with their per-rank (local) shape; `models/weights.py` fills them with the
right slice of the checkpoint. Column-parallel layers need no communication; row-parallel ones
sum the partial products with one all-reduce.

A parallel layer may hold its weight in FP8 (`to_fp8`, applied by `quantization/model.py`
before loading): e4m3 values, a float32 scale per output channel or per block, and for static
schemes one input scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.core import get_global_ctx
from minisgl_backend.distributed import all_reduce, get_tp_info
from minisgl_backend.lora.ops import LoraStack, add_lora


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ParallelLinear(nn.Module):
    """What the column- and row-parallel layers share: `weight` [out, in] multiplied in the
    model's dtype or, after `to_fp8`, as FP8."""

    weight: nn.Parameter
    fp8 = False
    block: tuple[int, int] | None = None  # the FP8 weight's scale block (None: per channel)
    lora: LoraStack | None = None  # LoRA adapter slots (`lora/weights.py`), where any targets it

    def to_fp8(self, block: tuple[int, int] | None, static_input: bool) -> None:
        """Hold the weight as FP8 from now on (on the meta device, before loading)."""
        out_features, in_features = self.weight.shape
        self.fp8, self.block = True, block
        self.weight = _param(out_features, in_features, dtype=torch.float8_e4m3fn)
        scale_shape = (-(-out_features // block[0]), -(-in_features // block[1])) if block \
            else (out_features, 1)
        self.weight_scale = _param(*scale_shape, dtype=torch.float32)
        # The static input scale (None: inputs quantized per token).
        self.register_parameter("input_scale",
                                _param(1, dtype=torch.float32) if static_input else None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fp8:
            out = F.linear(x, self.weight, bias)
        else:
            from minisgl_backend.quantization.fp8_ops import fp8_linear

            out = fp8_linear(x, self.weight, self.weight_scale, block=self.block,
                             input_scale=self.input_scale, bias=bias)
        if self.lora is not None:
            rows = get_global_ctx().batch.lora
            if rows is not None:  # some of this step's tokens take an adapter
                add_lora(out, x, self.lora, rows)
        return out


class ReplicatedLinear(nn.Module):
    """The whole weight on every rank (the MoE router)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MergedColumnParallelLinear(ParallelLinear):
    """Several column-parallel outputs in one GEMM (gate and up of the MLP).

    Each part is split along its output dimension; the local weight is the concatenation of
    every part's local slice.
    """

    def __init__(self, in_features: int, out_features: list[int]) -> None:
        super().__init__()
        tp = get_tp_info().size
        self.local_sizes = [divide(n, tp, "MLP intermediate size") for n in out_features]
        self.weight = _param(sum(self.local_sizes), in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class QKVParallelLinear(ParallelLinear):
    """q, k and v projections in one GEMM, split by heads, GQA-aware.

    Ranks split the KV heads, and each rank keeps the query heads that attend to its KV heads.
    When there are fewer KV heads than ranks, a KV head is replicated on several ranks.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool
    ) -> None:
        super().__init__()
        tp = get_tp_info().size
        self.num_local_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_local_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
        else:
            divide(tp, num_kv_heads, "tp_size over num_key_value_heads")
            self.num_local_kv_heads = 1
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = _param(out, hidden_size)
        self.bias = _param(out) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split(self.matmul(x, self.bias))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v parts (views) of this layer's output."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(ParallelLinear):
    """Split along the input dimension; the partial outputs are summed over ranks. The bias
    (whole on every rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, divide(in_features, get_tp_info().size, "in_features"))
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None or get_tp_info().size == 1:
            return all_reduce(self.matmul(x, self.bias))
        return all_reduce(self.matmul(x)) + self.bias
